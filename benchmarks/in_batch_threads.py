"""In-batch packing at torch's default intra-op threads while the other cores are busy (issue 15.2).

Collation often runs inside a busy training process. OpenMP kernels split small copies across threads; when
another core is taken, each parallel kernel waits for a descheduled thread. The core therefore runs CPU
packing on one intra-op thread (``vlm_pack.core.packing._OneIntraOpThread``). This script starts its own
background load (one busy-looping process per core but one, stopped at exit) and times, interleaved:

* ``1 thread``: ``torch.set_num_threads(1)`` around the call (the reference);
* ``default``: torch's default thread count, our core as shipped;
* ``before, default``: the core as it was before this change (``vlm_pack/packing.py`` at commit ``35861d7``, read
  from git at run time), at the default thread count: all-torch kernels, no thread scope.

Ratios are per round against ``1 thread`` (median, 10th-90th percentile). Goal: ``default`` within 1.5x.
Run: ``python benchmarks/in_batch_threads.py [--quick]``; writes ``benchmarks/results/in_batch_threads_cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_batch import padded_batch, sharegpt_like_lengths  # noqa: E402

from vlm_pack.core import packing  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def background_load(processes: int):
    """Busy-looping child processes, always stopped (by their own pids) when the block ends."""
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


BEFORE = "35861d7"


def core_before() -> types.ModuleType:
    """``vlm_pack/packing.py`` at ``BEFORE``, loaded from this repository's git history."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "-C", str(root), "show", f"{BEFORE}:vlm_pack/packing.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("vlm_pack_packing_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{BEFORE}:vlm_pack/packing.py", "exec"), module.__dict__)  # noqa: S102 - our own code
    return module


def measure(size: int, rounds: int, default_threads: int, before: types.ModuleType) -> dict[str, list[float]]:
    lengths = sharegpt_like_lengths(size, 4096, seed=size)
    b = padded_batch(lengths, 4096, "cpu")

    def call():
        packing.pack_batch_sequences(b["tokens"], b["labels"], b["loss_mask"], position_ids=b["position_ids"],
                                     padding_mask=b["mask"], pad_to_multiple_of=4)

    def one_thread():
        torch.set_num_threads(1)
        call()
        torch.set_num_threads(default_threads)

    def previous():
        before.pack_batch_sequences(b["tokens"], b["labels"], b["loss_mask"], position_ids=b["position_ids"],
                                    padding_mask=b["mask"], pad_to_multiple_of=4)

    modes = {"1 thread": one_thread, "default": call, "before, default": previous}
    for fn in modes.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in modes}
    names = list(modes)
    for r in range(rounds):
        for name in names[r % 3:] + names[: r % 3]:
            start = time.perf_counter()
            modes[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 20 if args.quick else args.rounds
    default_threads = torch.get_num_threads()
    cores = os.cpu_count() or 2
    load_before = os.getloadavg()[0]
    before = core_before()
    lines = [
        "# In-batch packing under CPU load, default intra-op threads", "",
        f"CPU: {cores} cores; torch default intra-op threads {default_threads}; background load: "
        f"{max(cores - 1, 1)} busy process(es) started by the script; load average before {load_before:.2f}. "
        f"S=4096, ShareGPT-like lengths, 4 fields, pad_to_multiple_of=4; {rounds} interleaved rounds. "
        "Regenerate: `python benchmarks/in_batch_threads.py`.", "",
        f"| micro-batch | background load | 1 thread (ms) | default (ms) | before {BEFORE}, default (ms) | "
        "default / 1 thread | before, default / 1 thread |",
        "|---|---|---|---|---|---|---|",
    ]
    for loaded in (False, True):
        for size in ((2, 32) if args.quick else (2, 8, 32, 128)):
            if loaded:
                with background_load(max(cores - 1, 1)):
                    times = measure(size, rounds, default_threads, before)
            else:
                times = measure(size, rounds, default_threads, before)
            base = np.asarray(times["1 thread"])

            def ratio(name: str) -> str:
                r = np.asarray(times[name]) / base
                return f"{np.median(r):.2f}x ({np.percentile(r, 10):.2f}-{np.percentile(r, 90):.2f})"

            med = {name: 1e3 * float(np.median(v)) for name, v in times.items()}
            lines.append(f"| {size} | {'yes' if loaded else 'no'} | {med['1 thread']:.3f} | {med['default']:.3f} | "
                         f"{med['before, default']:.3f} | {ratio('default')} | {ratio('before, default')} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "in_batch_threads_cpu.md").write_text(table)


if __name__ == "__main__":
    main()
