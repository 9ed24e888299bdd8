"""``vlm-pack`` console script: a thin dispatcher over the subcommands' own modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing ``add_parser(subparsers)``; the parser sets ``func(args) -> int``.
SUBCOMMANDS = {
    "demo": "vlm_pack.cli.demo_cli",
    "prepare": "vlm_pack.offline.cli",
    "plan-vlm": "vlm_pack.budget.cli",
    "stats": "vlm_pack.cli.stats",
    "verify": "vlm_pack.offline.verify",
    "doctor": "vlm_pack.cli.doctor",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``only``) just one subcommand's: importing a subcommand's module can be costly (the
    demo imports torch), and ``prepare`` on a warm cache must not pay for it."""
    parser = argparse.ArgumentParser(prog="vlm-pack", description="Exact sequence packing for VLM/LLM fine-tuning.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(subparsers)
    return parser


# What a Ctrl-C leaves behind: prepare and plan-vlm write into a temporary folder that is renamed into place only
# when complete, and remove it (prepare: also the output folder and lock file it created) when interrupted.
INTERRUPTED = {"prepare": "interrupted; nothing written", "plan-vlm": "interrupted; nothing written"}
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print(f"vlm-pack {args.command}: {INTERRUPTED.get(args.command, 'interrupted')}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError) as err:  # bad input, options or files: one line naming the fix, no traceback
        message = str(err) if str(err) else type(err).__name__
        print(f"vlm-pack {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
