"""``python -m vlm_pack``: the ``vlm-pack`` command (same subcommands, same torch-free ``--help``)."""

import sys

from vlm_pack.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
