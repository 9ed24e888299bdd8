"""The ``vlm-pack`` console script as a newcomer meets it: light ``--help``, help text on every option, Ctrl-C
answered with one line and exit 130 (prepare leaving nothing behind), ``verify`` finding the packed folder under
the output root, and ``plan-vlm`` warning when there are fewer packs than data-parallel ranks."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_pack.cli.main import SUBCOMMANDS, build_parser, main
from vlm_pack.offline.output import LOCK_NAME
from vlm_pack.offline.prepare import prepare_packed_sequence_data
from vlm_pack.offline.verify import find_packed_dir
from vlm_pack.testing.tiny_models import qwen_tokenizer_path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sft_sample.jsonl"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True, text=True, timeout=300)


def test_help_of_every_subcommand_imports_neither_torch_nor_transformers():
    """Through ``python -m vlm_pack`` (``vlm_pack/__main__.py`` run as ``-m`` runs it), every subcommand's help."""
    code = ("import runpy, sys; from vlm_pack.cli.main import SUBCOMMANDS\n"
            "for argv in [['--help']] + [[name, '--help'] for name in SUBCOMMANDS]:\n"
            "    sys.argv = ['vlm_pack', *argv]\n"
            "    try: runpy.run_module('vlm_pack', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as e: assert e.code == 0, argv\n"
            "    else: raise AssertionError(f'{argv}: no exit')\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'numba') if m in sys.modules))")
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert "usage: vlm-pack prepare" in run.stdout and run.stdout.strip().endswith("[]"), run.stdout[-300:]


def test_python_dash_m_vlm_pack_runs_the_cli_and_its_exit_code():
    """``python -m vlm_pack`` is the ``vlm-pack`` command: a bad input is its one-line error and exit 2."""
    run = subprocess.run([sys.executable, "-m", "vlm_pack", "verify", "/nonexistent/packs"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert run.stderr.startswith("vlm-pack verify: error: ") and run.stderr.count("\n") == 1, run.stderr


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_every_subcommand_a_description():
    subparsers = _subparsers(build_parser())
    assert set(subparsers) == set(SUBCOMMANDS)
    for name, sub in subparsers.items():
        assert sub.description, f"`vlm-pack {name} --help` has no description"
        silent = [a.dest for a in sub._actions if not isinstance(a, argparse._HelpAction) and not a.help]
        assert not silent, f"`vlm-pack {name}`: options without help text: {silent}"


# Runs `vlm-pack` in a fresh process that sends itself SIGINT (the Ctrl-C signal) at a chosen point: deterministic,
# no wall-clock race. `tokenizing`: output folder locked, temporary folder made, nothing tokenised yet;
# `commit`: every file written to the temporary folder, none moved into place.
INTERRUPT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background CI job starts with SIGINT ignored
from vlm_pack.offline import output, prepare
point, argv = sys.argv[1], sys.argv[2:]
owner, name = (prepare, "tokenized_splits") if point == "tokenizing" else (output.RunOutput, "commit")
real = getattr(owner, name)
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
setattr(owner, name, interrupted)
from vlm_pack.cli.main import main
sys.exit(main(argv))
"""


def _prepare_argv(root: Path, cache: Path, *extra: str) -> list[str]:
    return ["prepare", "--input", str(SAMPLE), "--tokenizer", str(qwen_tokenizer_path()), "--output-dir", str(root),
            "--pack-sizes", "2048", "--tokenizer-name", "t", "--cache-dir", str(cache), "--no-progress", *extra]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A tokenisation cache holding the sample (so the interrupted processes never load transformers), and the
    output of that first run."""
    root = tmp_path_factory.mktemp("warm")
    prepare_packed_sequence_data(SAMPLE, str(qwen_tokenizer_path()), root / "first", [2048], tokenizer_name="t",
                                 cache_dir=str(root / "cache"), progress=False, log=lambda _: None)
    return root / "cache"


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock file's: the pid of the run that last held it)."""
    return {str(p.relative_to(root)): b"" if p.name == LOCK_NAME else p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("point", ["tokenizing", "commit"])
def test_ctrl_c_in_a_fresh_output_folder_prints_one_line_exits_130_and_leaves_nothing(tmp_path, warm_cache, point):
    root = tmp_path / "out"
    run = _python(INTERRUPT, point, *_prepare_argv(root, warm_cache))
    assert run.returncode == 130, run.stderr
    assert run.stderr == "vlm-pack prepare: interrupted; nothing written\n"
    assert not root.exists()  # no output folder, lock file or temporary folder of this run


@pytest.mark.parametrize("point", ["tokenizing", "commit"])
def test_ctrl_c_during_overwrite_keeps_the_old_output_byte_for_byte(tmp_path, warm_cache, point):
    root = tmp_path / "out"
    assert main(_prepare_argv(root, warm_cache)) == 0
    before = _tree(root)
    # another seed: not the output already there (which a re-run would keep without tokenising or writing)
    run = _python(INTERRUPT, point, *_prepare_argv(root, warm_cache, "--seed", "1", "--overwrite"))
    assert (run.returncode, run.stderr) == (130, "vlm-pack prepare: interrupted; nothing written\n")
    assert _tree(root) == before  # old packs and metadata as they were, lock file kept; no `.prepare-*` folder


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_ctrl_c_in_any_subcommand_is_one_line_and_exit_130(command, monkeypatch, capsys):
    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, argv=None: argparse.Namespace(command=command, func=interrupted))
    assert main([command]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vlm-pack {command}: interrupted")


def test_verify_finds_the_one_packed_folder_under_the_output_root(tmp_path, warm_cache, capsys):
    root = tmp_path / "out"
    assert main(_prepare_argv(root, warm_cache)) == 0
    capsys.readouterr()
    assert find_packed_dir(root) == find_packed_dir(root / "packed") == root / "packed" / "t"
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"verifying {root / 'packed' / 't'}\n") and "ok   training_2048" in out


def test_verify_names_several_candidates_or_the_expected_layout(tmp_path, warm_cache, capsys):
    root = tmp_path / "out"
    for name in ("a", "b"):
        assert main(_prepare_argv(root, warm_cache, "--tokenizer-name", name)) == 0
    capsys.readouterr()
    assert main(["verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert "holds 2 packed folders" in err and str(root / "packed" / "a") in err and str(root / "packed" / "b") in err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert "<output-dir>/packed/<tokenizer-name>" in capsys.readouterr().out


def test_plan_vlm_warns_when_packs_are_fewer_than_data_parallel_ranks(tmp_path, processor, qwen2_config, capsys):
    from vlm_pack.testing.data import text_chat_examples

    processor.save_pretrained(tmp_path / "ckpt")
    qwen2_config.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in text_chat_examples(6, seed=1)))
    argv = ["plan-vlm", "--input", str(tmp_path / "data.jsonl"), "--processor", str(tmp_path / "ckpt"),
            "--output", str(tmp_path / "plan"), "--pack-size", "4096", "--no-progress"]
    assert main([*argv, "--data-parallel-size", "1"]) == 0
    assert "warning" not in capsys.readouterr().err  # 1 pack, 1 rank
    assert main([*argv, "--data-parallel-size", "8"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: 1 packs for 8 data-parallel ranks") and "--pack-size" in err
