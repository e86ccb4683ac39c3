"""Charts of BENCHMARKS.md, drawn from its own tables: one PNG per table that holds measured numbers.

    python benchmarks/charts.py [--md BENCHMARKS.md] [--out docs/benchmarks]

Each markdown table under a heading becomes one figure: a horizontal bar chart per numeric column, one bar per
row, the row named by its leading cells (e.g. batch and context). Cells that are not numbers ("not yet
measured", "–", ranges) draw no bar, so a chart never shows a value the table does not hold. ``--out`` gets
``NN-heading.png`` files and an ``index.md`` listing them with the heading each came from; rerun after editing
a table. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import NamedTuple

_RULE = re.compile(r"^\|[\s:|-]+\|$")
_ROW_NAMES = {"context", "shape", "remat"}
_NUMBER = re.compile(r"^[+-]?(\d[\d,]*\.?\d*|\.\d+)(e[+-]?\d+)?$", re.IGNORECASE)


class Table(NamedTuple):
    heading: str
    header: list[str]
    rows: list[list[str]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(cell: str) -> float | None:
    """A table cell as a number (thousands separators and markdown emphasis allowed), else None."""
    text = cell.replace("*", "").replace("`", "").strip()
    return float(text.replace(",", "")) if _NUMBER.match(text) else None


def tables(markdown: str) -> list[Table]:
    """Every table of ``markdown`` with the latest heading above it."""
    out, heading = [], ""
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and _RULE.match(lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(Table(heading, _cells(line), [_cells(r) for r in lines[i + 2: j]]))
            i = j
            continue
        i += 1
    return out


def series(table: Table) -> tuple[list[str], dict[str, list[float]]]:
    """(row labels, {column: values, NaN where a cell is not a number}) of the columns after the label columns
    that hold two numbers or more. Labels: the first column, and the second too where it names the row as well
    (``context``, ``shape``, ``remat``) or holds no number."""
    width = len(table.header)
    rows = [r + [""] * (width - len(r)) for r in table.rows]
    values = [[number(r[c]) for r in rows] for c in range(width)]
    keys = 2 if width > 2 and (table.header[1] in _ROW_NAMES or all(v is None for v in values[1])) else 1
    labels = [" / ".join(r[:keys]) for r in rows]
    cols = {table.header[c]: [math.nan if v is None else v for v in values[c]] for c in range(keys, width)
            if sum(v is not None for v in values[c]) >= 2}
    return labels, cols


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "table"


def draw(table: Table, path: Path) -> bool:
    """``table``'s chart at ``path``; False (nothing written) when it holds fewer than two numbers in a column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, cols = series(table)
    if not cols:
        return False
    fig, axes = plt.subplots(1, len(cols), figsize=(3.2 * len(cols) + 1.5, 0.35 * len(labels) + 1.4),
                             squeeze=False, sharey=True)
    for ax, (name, vals) in zip(axes[0], cols.items(), strict=True):
        ax.barh(range(len(labels)), [0 if math.isnan(v) else v for v in vals],
                color=["none" if math.isnan(v) else "tab:blue" for v in vals])
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    axes[0][0].set_yticks(range(len(labels)), labels)
    fig.suptitle(table.heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--md", default=str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = ["# Charts of BENCHMARKS.md", "", "Drawn by `python benchmarks/charts.py` from the tables of BENCHMARKS.md "
             "(one per table with numbers; cells that are not numbers draw no bar).", ""]
    for k, table in enumerate(tables(Path(args.md).read_text())):
        path = out / f"{k:02d}-{_slug(table.heading)}.png"
        if draw(table, path):
            index.append(f"- {table.heading}: ![]({path.name})")
            print(path)
    (out / "index.md").write_text("\n".join(index) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
