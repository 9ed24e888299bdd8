"""Regenerate the proof table of docs/families.md from the registry (vlm_pack.models.family_table).

    python scripts/families_table.py          # rewrite the page (atomically)
    python scripts/families_table.py --check  # exit 1 if the page is stale (tests/test_registry.py does the same)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from vlm_pack.models.table import with_family_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "families.md"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    fresh = with_family_table(page)
    if "--check" in argv:
        if fresh != page:
            print(f"{PAGE} is stale: run python scripts/families_table.py", file=sys.stderr)
            return 1
        return 0
    with tempfile.NamedTemporaryFile("w", dir=PAGE.parent, delete=False, suffix=".tmp") as out:
        out.write(fresh)
    os.replace(out.name, PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
