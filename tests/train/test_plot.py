"""``dsv41 plot``: each figure plots exactly the rows' values (a resumed step once, as its later row; the
compiling step's row, which has no rate, left out of throughput; a line cut short skipped), as PNG files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.cli import main
from dsv41_jax.train.plot import plot_run, read_rows, series

plt = pytest.importorskip("matplotlib.pyplot")


def _row(step: int, loss: float, rate: bool = True) -> dict:
    row = {"step": step, "loss": loss, "ce": loss - 0.01, "lr": 1e-3 * step, "imbalance": 1.0 + 0.1 * step,
           "balance": 1e-3, "grad_norm": 1.0, "skipped": 0.0}
    return row | ({"tokens_per_s": 100.0 * step, "step_s": 0.1} if rate else {})


@pytest.fixture
def run_dir(tmp_path):
    rows = [_row(1, 9.0, rate=False), _row(2, 8.0), _row(3, 7.5), _row(2, 7.9), _row(3, 7.2), _row(4, 6.0)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "loss": 5.'  # a run resumed at 1, then cut
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_rows_one_per_step_later_wins(run_dir):
    rows = read_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 9.0), (2, 7.9), (3, 7.2), (4, 6.0)]
    assert series(rows, "tokens_per_s") == ([2, 3, 4], [200.0, 300.0, 400.0])  # step 1 compiled: no rate


def test_figures_hold_the_rows_values(run_dir, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault(fig.axes[0].get_title().split(":")[0], fig))
    written = plot_run(run_dir)
    assert sorted(written) == ["imbalance", "loss", "lr", "throughput"]
    want = {"loss": [[1, 2, 3, 4], [9.0, 7.9, 7.2, 6.0]], "lr": [[1, 2, 3, 4], [1e-3, 2e-3, 3e-3, 4e-3]],
            "throughput": [[2, 3, 4], [200.0, 300.0, 400.0]], "imbalance": [[1, 2, 3, 4], [1.1, 1.2, 1.3, 1.4]]}
    for name, (steps, values) in want.items():
        np.testing.assert_allclose(drawn[name].axes[0].lines[0].get_xydata(), np.c_[steps, values], rtol=1e-12)
        image = plt.imread(written[name])
        assert written[name] == run_dir / "plots" / f"{name}.png" and image.shape[:2] == (400, 700)
        assert image[..., :3].std() > 0  # something drawn
    assert [line.get_label() for line in drawn["loss"].axes[0].lines] == ["loss", "cross-entropy"]


def test_cli(run_dir, tmp_path, capsys):
    assert main(["plot", str(run_dir / "metrics.jsonl"), "--out", str(tmp_path / "png")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"loss: {tmp_path / 'png' / 'loss.png'}"
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
