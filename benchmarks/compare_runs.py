"""How far two runs of the same benchmark agree: every ratio cell (``1.23x``) of one results table against the
same cell of another run's table, as a relative deviation.

    python benchmarks/compare_runs.py benchmarks/results/in_batch_cpu.md benchmarks/results/repeats/in_batch_cpu.md

Prints the number of ratio cells, the median and the largest deviation (with the row it sits in), and exits 1
when the largest exceeds ``--tolerance`` (default 0.2: "reproduces within 20%").
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

RATIO = re.compile(r"^(\d+(?:\.\d+)?)x\b")


def ratio_cells(path: Path) -> list[tuple[str, float]]:
    """(row label, ratio) for the leading ratio of every table cell, in file order."""
    cells = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        for part in parts:
            match = RATIO.match(part)
            if match:
                cells.append((" | ".join(parts[:2]), float(match.group(1))))
    return cells


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.2)
    args = parser.parse_args(argv)
    first, second = ratio_cells(args.first), ratio_cells(args.second)
    if len(first) != len(second) or not first:
        print(f"the tables differ in shape: {len(first)} vs {len(second)} ratio cells", file=sys.stderr)
        return 2
    deviations = [(abs(b / a - 1), row) for (row, a), (_, b) in zip(first, second)]
    worst, where = max(deviations)
    print(f"{len(deviations)} ratio cells: median deviation {100 * statistics.median(d for d, _ in deviations):.1f}%, "
          f"largest {100 * worst:.1f}% (row {where})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
