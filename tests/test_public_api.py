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
