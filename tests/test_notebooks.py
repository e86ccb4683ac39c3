"""notebooks/: every .ipynb is the jupytext pairing of its percent-format .py (same cells, no outputs), and the
tour runs to the end on the tiny config (its own asserts check the library)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NOTEBOOKS = REPO / "notebooks"
STEMS = sorted({p.stem for p in NOTEBOOKS.glob("*.py")} | {p.stem for p in NOTEBOOKS.glob("*.ipynb")})


def percent_cells(text: str) -> list[tuple[str, str]]:
    """(cell type, source) of a jupytext percent-format script: ``# %%`` code cells, ``# %% [markdown]`` cells
    whose lines are commented with ``# ``; the ``# ---`` header is notebook metadata, not a cell."""
    lines = text.splitlines()
    if lines and lines[0] == "# ---":
        lines = lines[lines.index("# ---", 1) + 1:]
    cells: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("# %%"):
            marker = re.fullmatch(r"# %%( \[markdown\])?", line)
            assert marker, f"unsupported cell marker {line!r}: use '# %%' or '# %% [markdown]'"
            cells.append(("markdown" if marker.group(1) else "code", []))
        elif cells:
            cells[-1][1].append(line)
        else:
            assert not line.strip(), f"text before the first cell marker: {line!r}"
    out = []
    for kind, body in cells:
        while body and not body[-1].strip():  # the blank lines between cells belong to neither
            body.pop()
        if kind == "markdown":
            body = [b[2:] if b.startswith("# ") else b.removeprefix("#") for b in body]
        out.append((kind, "\n".join(body)))
    return out


@pytest.mark.parametrize("stem", STEMS)
def test_ipynb_and_py_hold_the_same_cells(stem):
    py, ipynb = NOTEBOOKS / f"{stem}.py", NOTEBOOKS / f"{stem}.ipynb"
    assert py.is_file() and ipynb.is_file(), f"{stem}: notebooks come in pairs (.py and .ipynb)"
    nb = json.loads(ipynb.read_text())
    assert nb["nbformat"] == 4 and nb["metadata"]["jupytext"]["formats"] == "ipynb,py:percent"
    want = percent_cells(py.read_text())
    got = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        assert a == b, f"cell {i} differs between {ipynb.name} and {py.name}; run `jupytext --sync {py}`"
    assert len(got) == len(want), f"{ipynb.name} has {len(got)} cells, {py.name} {len(want)}"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"]
               if c["cell_type"] == "code"), f"{ipynb.name}: commit notebooks without outputs"


@pytest.mark.slow  # compiles the tiny model's forward, prefill, decode and generator (~50 s of CPU)
def test_tour_runs():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    code = f"import runpy; runpy.run_path({str(NOTEBOOKS / 'tour.py')!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=NOTEBOOKS, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "release  global KV   890.0 B/token" in proc.stdout
