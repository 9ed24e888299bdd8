"""Out-of-suite stream checks (issue 45): ``N`` launches of the 2-rank x 2-worker streaming cases of
tests/_multiprocess_worker.py (gloo, OMP_NUM_THREADS=1): JSONL files, a rank failing, and a generator stream with a
list argument of its own named ``shards``; resumed runs load the tokenizer from a folder of their own. Each launch is
checked (every sample once per epoch across the ranks, equal steps, resume from checkpoint-3 and -6 equal to the
uninterrupted run; both ranks stop on the failing rank's error) and its log searched for "terminate called" (the
rare exit SIGABRT once seen). Run: ``python scripts/stream_launches.py [N]``; prints one line per launch and the
counts; logs of failed launches are kept in a temporary folder it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "_multiprocess_worker.py"
CASES = ("stream_2_files", "stream_error", "stream_generator")


def check(results: dict) -> None:
    for case in ("stream_2_files", "stream_generator"):
        got = results[case]
        ranks = got["ranks"]
        assert len(ranks[0]["full"]) == len(ranks[1]["full"]) == 18, case
        starts = [[next(i for i, x in enumerate(r["full"]) if x != "pad" and x[0] == e) for e in (1, 2)] for r in ranks]
        assert starts[0] == starts[1] and 2 * 3 < starts[0][0] <= 2 * 6, (case, starts)
        for epoch in (0, 1):
            keys = [tuple(k) for r in ranks for x in r["full"] if x != "pad" and x[0] == epoch for k in x[1]]
            assert len(keys) == len(set(keys)) == got["samples"], (case, epoch)
        for r in ranks:
            for step in ("3", "6"):
                assert r["resumed"][step] == r["full"][2 * int(step):], (case, step)
    rank0, rank1 = results["stream_error"]["ranks"]
    assert "line 20: " in rank1["error"] and "rank 1 failed reading its streaming packs" in rank0["error"]


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    keep = Path(tempfile.mkdtemp(prefix="stream_launches_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    counts = {"green": 0, "failed": 0, "aborts": 0}
    for i in range(launches):
        with tempfile.TemporaryDirectory() as scratch:
            output = Path(scratch) / "results.json"
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                   "2", str(WORKER), str(output), *CASES], env=env, capture_output=True, text=True,
                                  timeout=900)
            log = done.stdout + done.stderr
            aborts = log.count("terminate called")
            try:
                assert done.returncode == 0, f"exit {done.returncode}"
                check(json.loads(output.read_text()))
                ok = aborts == 0
            except (AssertionError, FileNotFoundError, KeyError) as err:
                ok, log = False, f"{log}\n{err!r}"
        counts["green" if ok else "failed"] += 1
        counts["aborts"] += aborts
        if not ok:
            (keep / f"launch{i}.log").write_text(log)
        print(f"launch {i}: {'green' if ok else 'FAILED'} (exit {done.returncode}, terminate lines {aborts})",
              flush=True)
    print(f"{launches} launches: {counts} (failed logs in {keep})")


if __name__ == "__main__":
    main()
