"""README.md runs as written: every fenced ``python`` and ``bash`` block, verbatim, in README order.

The rules a README block follows (a new block that breaks them fails here):

* A block is self-contained: its first lines build what it uses (the shipped stand-ins of ``vlm_pack.testing.tiny_models``,
  ``vlm_pack.testing.tiny_families``, ``vlm_pack.testing.data``, ``vlm_pack.assets``), or its first line is
  ``# continues the block above``: it then runs right after that block, in the same scratch folder (files the
  block above wrote) and, for python, the same namespace. Nothing is injected.
* A self-contained block and the blocks continuing it form one test case (parametrized, so ``pytest -n 2`` runs
  them side by side) in its own scratch folder: symlinks to the repository's top-level files and folders, and
  ``.venv`` to the running venv.
* bash: ``bash -e`` in the scratch folder, the venv's ``bin/`` first on PATH (as after ``source .venv/bin/activate``)
  and ``VLM_PACK_CACHE`` inside the scratch folder.
* Skipped: only the set-up block (the one calling ``scripts/setup.sh``): it rebuilds ``.venv`` and runs this very
  suite. Its commands are checked instead (the test command is CI's, the demo command parses).
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONTINUES = "# continues the block above"
SETUP = "scripts/setup.sh"


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # README line of the opening fence

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang}: {self.code.splitlines()[0][:70]!r})"


BLOCKS = [Block(m["lang"], m["code"], README.count("\n", 0, m.start()) + 1)
          for m in re.finditer(r"^```(?P<lang>python|bash)\n(?P<code>.*?)^```", README, flags=re.S | re.M)]


CHAINS: list[list[Block]] = []
for _block in BLOCKS:
    if SETUP in _block.code:
        continue
    if _block.code.startswith(CONTINUES):
        assert CHAINS, f"{_block} continues a block, but none comes before it"
        CHAINS[-1].append(_block)
    else:
        CHAINS.append([_block])


@pytest.mark.parametrize("chain", CHAINS, ids=[f"line{chain[0].line}" for chain in CHAINS])
def test_readme_block_runs_as_written(chain, tmp_path, monkeypatch):
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / ".venv").symlink_to(sys.prefix)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "VLM_PACK_CACHE": str(tmp_path / "cache")}
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for block in chain:
        if block.lang == "bash":
            run = subprocess.run(["bash", "-e", "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=600)
            assert run.returncode == 0, f"{block} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        else:
            exec(compile(block.code, str(block), "exec"), namespace)


def test_every_block_but_the_set_up_one_is_run():
    assert sum(map(len, CHAINS)) == len(BLOCKS) - 1 >= 10
    fences = set(re.findall(r"^```(\S+)", README, flags=re.M))
    assert fences <= {"python", "bash"}, f"code blocks this test would not run: {fences - {'python', 'bash'}}"


def test_the_only_skipped_block_is_the_set_up_one_and_its_commands_hold():
    setup = [block for block in BLOCKS if SETUP in block.code]
    assert len(setup) == 1 and setup[0] == BLOCKS[0], "only the first block may call scripts/setup.sh"
    commands = [line.split(" && ", 1)[1] for line in setup[0].code.splitlines() if line.startswith(f"bash {SETUP} && ")]
    assert commands == [".venv/bin/vlm-pack demo", ".venv/bin/python -m pytest -q -n 2"]
    assert f"bash {SETUP} && {commands[1]}" in (ROOT / ".ci" / "run").read_text()  # CI runs what the README says
    demo = subprocess.run([str(Path(sys.executable).parent / "vlm-pack"), "demo", "--help"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert demo.returncode == 0 and "usage: vlm-pack demo" in demo.stdout, demo.stderr


def test_supported_families_table_lists_every_registered_family_with_its_proof():
    from vlm_pack.models import registered_families

    section = README.split("### Supported model families", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and "(`" in line.split("|")[1] and "`model_type`" not in line]
    listed = set(re.findall(r"`([a-z0-9_]+)`", " ".join(row.split("|")[1] for row in rows)))
    registered = registered_families()
    types = {t for spec in registered.values() for t in spec.model_types}
    assert types == listed, f"registered, not in the table: {types - listed}; not registered: {listed - types}"
    assert set(registered) <= listed, f"families missing from the README table: {set(registered) - listed}"
    root = Path(__file__).resolve().parents[1]
    for spec in registered.values():
        assert (root / spec.proof).is_file(), spec.proof
        assert any(spec.proof in row for row in rows if f"`{spec.name}`" in row), f"{spec.name}: proof not linked"
