"""Every name vlm_pack exports resolves (lazy ones included), and the console script lists its subcommands."""

import pytest

import vlm_pack
from vlm_pack.cli import SUBCOMMANDS, build_parser


@pytest.mark.parametrize("name", vlm_pack.__all__)
def test_export_resolves(name):
    assert getattr(vlm_pack, name) is not None


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vlm_pack.nope


def test_cli_has_every_subcommand():
    help_text = build_parser().format_help()
    assert all(name in help_text for name in SUBCOMMANDS)


def test_library_never_imports_the_fixtures():
    """Every module of the library but the demo (a user of it) imports without loading ``vlm_pack.testing``."""
    import pkgutil
    import subprocess
    import sys

    import vlm_pack

    modules = [m.name for m in pkgutil.walk_packages(vlm_pack.__path__, "vlm_pack.")
               if not m.name.startswith("vlm_pack.testing") and m.name not in ("vlm_pack.demo", "vlm_pack.__main__")]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('vlm_pack.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
