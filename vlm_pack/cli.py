"""``vlm-pack`` console script: a thin dispatcher over the subcommands' own modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing ``add_parser(subparsers)``; the parser sets ``func(args) -> int``.
SUBCOMMANDS = {
    "demo": "vlm_pack.demo",
    "prepare": "vlm_pack.offline.cli",
    "plan-vlm": "vlm_pack.budget.cli",
    "stats": "vlm_pack.stats",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-pack", description="Exact sequence packing for VLM/LLM fine-tuning.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"vlm-pack {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
