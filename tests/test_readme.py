"""README.md and docs/*.md run as written: every fenced ``python`` and ``bash`` block, verbatim, page by page.

The rules a block follows (a new block that breaks them fails here):

* A block is self-contained: its first lines build what it uses (the shipped stand-ins of ``vlm_pack.testing.tiny_models``,
  ``vlm_pack.testing.tiny_families``, ``vlm_pack.testing.data``, ``vlm_pack.assets``), or its first line is
  ``# continues the block above``: it then runs right after the block above it ON THE SAME PAGE, in the same
  scratch folder (files the block above wrote) and, for python, the same namespace. Chains never cross pages.
  Nothing is injected.
* A self-contained block and the blocks continuing it form one test case (parametrized, so ``pytest -n 2`` runs
  them side by side, id ``page:line`` of its first block) in its own scratch folder: symlinks to the repository's
  top-level files and folders, and ``.venv`` to the running venv.
* bash: ``bash -e`` in the scratch folder, the venv's ``bin/`` first on PATH (as after ``source .venv/bin/activate``)
  and ``VLM_PACK_CACHE`` inside the scratch folder.
* Fences: ``python`` and ``bash`` run; a plain fence (no language: output, trees) is text; any other language fails.
* Skipped: only the README's set-up block (the one calling ``scripts/setup.sh``): it rebuilds ``.venv`` and runs this
  very suite. Its commands are checked instead (the test command is CI's, the demo command parses).

The text is checked too: every relative link (and ``#anchor``) resolves, every ``vlm_pack.<name>`` imports, every
``vlm_pack/<path>`` and backticked ``tests/``, ``benchmarks/``, ``examples/``, ``configs/``, ``scripts/`` path exists,
and every page is listed in docs/README.md.
"""

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README = PAGES["README.md"]
CONTINUES = "# continues the block above"
SETUP = "scripts/setup.sh"
FENCE = re.compile(r"^```(?P<lang>[^\s`]*)\n(?P<code>.*?)^```[ \t]*$", flags=re.S | re.M)
RUN = {"python", "bash"}


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    code: str
    line: int  # page line of the opening fence

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang}: {self.code.splitlines()[0][:70]!r})"


def _fences(page: str) -> list[Block]:
    text = PAGES[page]
    return [Block(page, m["lang"], m["code"], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


FENCES = [block for page in PAGES for block in _fences(page)]
BLOCKS = [block for block in FENCES if block.lang in RUN]

CHAINS: list[list[Block]] = []
for _block in BLOCKS:
    if SETUP in _block.code:
        continue
    if _block.code.startswith(CONTINUES):
        assert CHAINS and CHAINS[-1][0].page == _block.page, f"{_block} continues a block, but none comes before it on its page"
        CHAINS[-1].append(_block)
    else:
        CHAINS.append([_block])


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{chain[0].page}:{chain[0].line}" for chain in CHAINS])
def test_block_runs_as_written(chain, tmp_path, monkeypatch):
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
            refused = re.search(r"UnsupportedVersionError: (.*)", run.stderr)
            if run.returncode != 0 and refused:  # proven only on later releases (as tests/conftest.py skips them)
                pytest.skip(f"{block}: {refused.group(1)}")
            assert run.returncode == 0, f"{block} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        else:
            exec(compile(block.code, str(block), "exec"), namespace)


def test_every_block_but_the_set_up_one_is_run():
    # 14 blocks ran when the README held them all (before docs/ existed); moving text must not lose any
    assert sum(map(len, CHAINS)) == len(BLOCKS) - 1 >= 15
    other = {f"{block.page}:{block.line} ```{block.lang}" for block in FENCES if block.lang not in RUN | {""}}
    assert not other, f"code blocks this test would not run (use python, bash, or a plain fence for text): {other}"
    for page, text in PAGES.items():  # an unclosed or indented fence would hide blocks from the pattern above
        opening_or_closing = len(re.findall(r"^```", text, flags=re.M))
        assert opening_or_closing == 2 * len(_fences(page)), f"{page}: a fence is not closed at line start"


def test_the_only_skipped_block_is_the_set_up_one_and_its_commands_hold():
    setup = [block for block in BLOCKS if SETUP in block.code]
    assert len(setup) == 1 and setup[0] == BLOCKS[0], "only the README's first block may call scripts/setup.sh"
    commands = [line.split(" && ", 1)[1] for line in setup[0].code.splitlines() if line.startswith(f"bash {SETUP} && ")]
    assert commands == [".venv/bin/vlm-pack demo", ".venv/bin/python -m pytest -q -n 2"]
    assert f"bash {SETUP} && {commands[1]}" in (ROOT / ".ci" / "run").read_text()  # CI runs what the README says
    demo = subprocess.run([str(Path(sys.executable).parent / "vlm-pack"), "demo", "--help"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert demo.returncode == 0 and "usage: vlm-pack demo" in demo.stdout, demo.stderr


def test_supported_families_table_lists_every_registered_family():
    """The rules table lists every registered model type; each family's proofs are linked by the generated
    per-path table (tests/test_registry.py)."""
    from vlm_pack.models import registered_families

    assert "(docs/families.md)" in README, "the README links the families table"
    section = PAGES["docs/families.md"].split("## Supported model families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and "(`" in line.split("|")[1] and "`model_type`" not in line]
    listed = set(re.findall(r"`([a-z0-9_]+)`", " ".join(row.split("|")[1] for row in rows)))
    registered = registered_families()
    types = {t for spec in registered.values() for t in spec.model_types}
    assert types == listed, f"registered, not in the table: {types - listed}; not registered: {listed - types}"
    assert set(registered) <= listed, f"families missing from the docs/families.md table: {set(registered) - listed}"


# ---- the text: links, module names, paths ----

def _prose(text: str) -> str:
    """The page without its fenced blocks (a ``#`` line inside a bash block is no heading)."""
    return FENCE.sub("", text)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+?)\s*$", _prose(text), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def _links(page: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", _prose(PAGES[page]))
            if not re.match(r"[a-z]+:", target)]


def _resolves(name: str) -> bool:
    """``vlm_pack.a.b.c``: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("page", list(PAGES))
def test_links_resolve(page):
    here = (ROOT / page).parent
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else ROOT / page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page}: {broken}"


@pytest.mark.parametrize("page", list(PAGES))
def test_named_modules_and_paths_exist(page):
    text = PAGES[page]
    names = sorted(set(re.findall(r"\bvlm_pack(?:\.[A-Za-z_]\w*)+(?![\w/])", text)))  # not a tag "x.y/1"
    assert all(name.count(".") for name in names)
    missing = [name for name in names if not _resolves(name)]
    paths = set(re.findall(r"\b(vlm_pack/[\w./-]*)(?!<)", text))
    # a placeholder such as `tests/test_family_<family>.py` names no file
    paths |= set(re.findall(r"`((?:tests|benchmarks|examples|configs|scripts)/[\w./-]+)(?![\w./<-])", text))
    missing += [path for path in sorted(paths) if "*" not in path and not (ROOT / path.rstrip(".")).exists()]
    assert not missing, f"{page} names what does not exist: {missing}"


def test_every_docs_page_is_in_the_index():
    linked = {target.partition("#")[0] for target in _links("docs/README.md")}
    pages = {page.removeprefix("docs/") for page in PAGES if page.startswith("docs/") and page != "docs/README.md"}
    assert pages <= linked, f"docs pages missing from docs/README.md: {pages - linked}"
    assert "docs/README.md" in _links("README.md"), "the README links the docs index"
