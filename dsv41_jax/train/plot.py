"""``dsv41 plot RUN_DIR``: a run's curves as PNG files, from its ``metrics.jsonl`` (one row per logged step,
:mod:`dsv41_jax.train.report`).

Four figures, each written as ``<name>.png``:

- ``loss``: the objective and its cross-entropy (and the validation loss where the run logged one);
- ``lr``: the learning rate of the schedule (spec model §9.4);
- ``throughput``: tokens per second; the row of a step that compiled has no rate and
  is left out, so the compile never looks like a slow step;
- ``imbalance``: the busiest expert's load over the mean load, worst MoE layer (1.0 is balanced).

A step logged twice (a run resumed from an earlier checkpoint logs the steps after it again) is plotted once,
as its later row, the rule :func:`~dsv41_jax.train.report.truncate_metrics` keeps; a line a crash cut short is
skipped. matplotlib is the optional ``plot`` extra (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv41_jax.config import ConfigError

# figure name → (y-axis label, [(metric, legend label)])
FIGURES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "loss": ("loss", [("loss", "loss"), ("ce", "cross-entropy"), ("val_loss", "validation loss")]),
    "lr": ("learning rate", [("lr", "lr")]),
    "throughput": ("tokens / s", [("tokens_per_s", "tokens / s")]),
    "imbalance": ("max load / mean load", [("imbalance", "expert imbalance")]),
}


def metrics_path(run: str | Path) -> Path:
    """``run``'s ``metrics.jsonl`` (``run`` is a run directory or the file itself), or a ConfigError."""
    from dsv41_jax.train.remote import is_uri, local_run

    if is_uri(run) and str(run).endswith(".jsonl"):
        raise ConfigError(f"{run}: a metrics file at a URI; give the run directory's URI (its metrics.jsonl is read "
                          "from the run's local mirror)")
    run = local_run(run, log=lambda _: None) if is_uri(run) else Path(run)
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ConfigError(f"{path}: no such metrics file; give a `dsv41 train` run directory (its checkpoint.dir) "
                          "or the metrics.jsonl of one")
    return path


def read_rows(path: Path) -> list[dict]:
    """The rows of ``path`` by step, one per step (the later row of a step logged twice), whole lines only."""
    by_step: dict[int, dict] = {}
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    if not by_step:
        raise ConfigError(f"{path}: holds no metrics rows (a run logs one per logging.every steps)")
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold ``key``."""
    kept = [r for r in rows if isinstance(r.get(key), (int, float))]
    return [r["step"] for r in kept], [float(r[key]) for r in kept]


def plot_run(run: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """Write the figures of ``run`` into ``out`` (default ``<run>/plots``); returns name → PNG path. A figure
    none of whose metrics the run logged is not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError(f"dsv41 plot needs matplotlib: pip install -e \".[plot]\" ({err})") from err
    path = metrics_path(run)
    rows = read_rows(path)
    out = Path(out) if out is not None else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (ylabel, keys) in FIGURES.items():
        lines = [(label, *series(rows, key)) for key, label in keys]
        lines = [line for line in lines if line[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for label, steps, values in lines:
            ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{name}: {path.parent.name}")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        fig.tight_layout()
        written[name] = out / f"{name}.png"
        fig.savefig(written[name])
        plt.close(fig)
    return written
