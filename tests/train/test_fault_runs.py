"""Faults in real training runs (``train.loop.train`` over the real jitted step of a 2-layer tiny variant,
compiled once for the module): a batch whose loss is NaN, in both ``nonfinite`` modes, a disk that fills in
the middle of a run, a SIGTERM (the step in progress saved, then resumed), and the held-out validation loss.
The NaN is genuine: the batch holds a token id outside the vocabulary, so the target's log-probability is NaN
(out-of-bounds reads fill with NaN); the real step then applies nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fault_testing import fill, small_disk

from dsv41_jax.data.pipeline import DataState
from dsv41_jax.train.checkpoint import RunCheckpointer
from dsv41_jax.train.config import from_dict
from dsv41_jax.train.guard import Preempted, TrainingStopped
from dsv41_jax.train.loop import setup, train

MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2, "mhc": {"hc_sinkhorn_iters": 2},
         "attention": {"compress_ratios": [2, 1, 0, 0, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                       "candidate_source_layer": 1},
         "engram": {"layer_ids": [0, 1]}, "dspark": {"target_layer_ids": [0, 1, 1]}}
BASE = {"model": MODEL,
        "optim": {"lr": 2.0e-3, "warmup_steps": 2, "constant_until": 100, "decay_until": 200, "total_steps": 300,
                  "ns_steps": 2, "ns_tail_steps": 0, "sinkhorn_iters": 2},
        "data": {"max_documents": 30, "tokenizer_train_documents": 30, "seq_len": 16, "batch_size": 2,
                 "read_threads": 0}}


def _cfg(run_dir, steps: int, every: int = 1, keep: int = 5, **more):
    return from_dict(BASE | {"checkpoint": {"dir": str(run_dir), "every": every, "keep": keep}, "steps": steps,
                             "logging": {"every": 1, "tensorboard": None}} | more, "test_fault_runs")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """(Run, its initial state, a fresh copy function); the step compiles at its first call."""
    run = setup(_cfg(tmp_path_factory.mktemp("base"), 1), log=lambda _: None)
    run.checkpointer.close()
    fresh = jax.tree.map(jnp.copy, run.state)
    return run, fresh


class Steps:
    """The run's real step; before the steps in ``events`` it runs the event (corrupt the batch, fill the disk)
    and it keeps a host copy of the state it is given at each step (the previous step's result)."""

    def __init__(self, step_fn, events: dict, checkpointer: RunCheckpointer):
        self.step_fn, self.events, self.seen, self.checkpointer = step_fn, events, {}, checkpointer

    def __call__(self, state, batch):
        step = int(state.step) + 1
        self.seen[step - 1] = jax.device_get(state)
        if step in self.events:
            batch = self.events[step](self, batch)
        return self.step_fn(state, batch)


def out_of_vocabulary(steps, batch):
    return dict(batch, tokens=batch["tokens"].at[0, 0, 3].set(10**6))


def _start(base_run, cfg, events: dict):
    run, fresh = base_run
    ck = RunCheckpointer(cfg.checkpoint.dir, cfg.checkpoint.every, cfg.checkpoint.keep)
    steps = Steps(run.step_fn, events, ck)
    return dataclasses.replace(run, cfg=cfg, state=jax.tree.map(jnp.copy, fresh), step_fn=steps, checkpointer=ck,
                               data=DataState(iter(run.dataset))), steps


def _restored(run_dir, like):
    ck = RunCheckpointer(run_dir, every=1, keep=5)
    step, state, _ = ck.restore_latest(like, log=lambda _: None)
    ck.close()
    return step, state


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_loss_stops_the_run_and_keeps_the_finite_checkpoint(base_run, tmp_path):
    cfg = _cfg(tmp_path / "run", steps=5, keep=1)  # keep-last-1: retention would delete step 2 for a step 3
    run, steps = _start(base_run, cfg, {3: out_of_vocabulary})
    with pytest.raises(TrainingStopped) as err:
        train(cfg, run=run, log=lambda _: None)
    assert str(err.value) == (
        "step 3: loss and gradient norm are not finite (loss nan, gradient norm nan); the update was not applied and "
        "training stops "
        "(nonfinite.action=stop). Lower optim.lr, or set nonfinite.action=skip to drop such batches. The last good "
        f"checkpoint is step 2 at {run.checkpointer.dir / '2'}: the same command resumes from there")
    assert sorted(p.name for p in run.checkpointer.dir.iterdir()) == ["2"]
    step, state = _restored(cfg.checkpoint.dir, run.state)
    assert step == 2
    _same(state, steps.seen[2])  # what step 2 produced, finite
    assert [(r["step"], r["skipped"]) for r in _rows(tmp_path / "run")] == [(1, 0.0), (2, 0.0), (3, 1.0)]


def test_skip_drops_the_nan_batch_and_goes_on(base_run, tmp_path):
    cfg = _cfg(tmp_path / "run", steps=4, nonfinite={"action": "skip", "max_skips": 1})
    run, steps = _start(base_run, cfg, {2: out_of_vocabulary})
    lines: list[str] = []
    history = train(cfg, run=run, log=lines.append)
    assert "step 2: loss and gradient norm are not finite (loss nan, gradient norm nan): batch dropped, the state " \
        "is unchanged (1 of at most 1, nonfinite.action=skip)" in lines, lines
    assert [m["skipped"] for m in history] == [0.0, 1.0, 0.0, 0.0] and np.isfinite(history[-1]["loss"])
    # the first step compiles: its time is reported on its own line and in no row's rate
    assert "compiling the train step (step 1) …" in lines and any(
        line.startswith("step 1 compiled and ran in ") for line in lines), lines
    assert "tokens_per_s" not in history[0] and all(m["tokens_per_s"] > 0 for m in history[1:])
    _same(steps.seen[2][1:], steps.seen[1][1:])  # step 2 changed nothing but the step counter
    assert int(steps.seen[2].step) == 2
    assert _restored(cfg.checkpoint.dir, run.state)[0] == 4


def test_a_disk_that_fills_mid_run_stops_it_promptly_with_the_last_good_step_intact(base_run, tmp_path,
                                                                                    monkeypatch):
    with small_disk(tmp_path / "disk", 48) as mounted:
        run_dir = tmp_path / "disk" / "run"
        cfg = _cfg(run_dir, steps=6)
        store = pytest.importorskip("orbax.checkpoint._src.metadata.checkpoint")._MetadataStoreImpl

        def full(self, path, meta):
            raise OSError(28, "No space left on device")

        def event(steps, batch):  # once step 2's checkpoint is on disk, the disk fills up
            steps.checkpointer.manager.wait_until_finished()
            if mounted:  # a real full disk: every writer fails as it would
                fill(run_dir, leave=32 << 10)
            else:  # no tmpfs here: Orbax's background metadata writer reports a full disk from then on
                monkeypatch.setattr(store, "write", full)
            return batch
        run, steps = _start(base_run, cfg, {3: event})
        t0 = time.monotonic()
        with pytest.raises(TrainingStopped) as err:
            train(cfg, run=run, log=lambda _: None)
        took = time.monotonic() - t0
        message = str(err.value)
        assert message.startswith(f"saving checkpoint step 3 to {run.checkpointer.dir} failed (") and \
            "No space left on device" in message, message
        assert message.endswith(f"The last good checkpoint is step 2 at {run.checkpointer.dir / '2'}: the same "
                                "command resumes from there"), message
        assert took < 60, took  # no minutes of timeouts on the way out
        rows = _rows(run_dir)  # whole lines only
        assert [r["step"] for r in rows[:2]] == [1, 2] and rows[-1]["step"] <= 4, rows
        monkeypatch.undo()
        step, state = _restored(run_dir, run.state)
        assert step == 2
        _same(state, steps.seen[2])


def test_validation_loss_of_held_out_documents(base_run, tmp_path):
    """validation.documents are held out of the run's corpus; val_loss at every validation.every steps and at
    the end equals the train step's own cross-entropy (its objective, a separate code path) on those batches."""
    cfg = _cfg(tmp_path / "run", steps=3, every=0, validation={"documents": 6, "every": 2, "batches": 2})
    lines: list[str] = []
    run = dataclasses.replace(setup(cfg, log=lines.append), step_fn=base_run[0].step_fn)  # the compiled step
    assert "; 24 documents (and 6 held out); " in lines[0], lines[0]
    history = train(cfg, run=run, log=lambda _: None)
    assert ["val_loss" in m for m in history] == [False, True, True]
    assert [r.get("val_loss") for r in _rows(tmp_path / "run")] == [m.get("val_loss") for m in history]
    sums = [run.step_fn(jax.tree.map(jnp.copy, run.state), b)[1] for b in run.validator.batches]
    want = sum(float(m["ce"]) * float(m["tokens"]) for m in sums) / sum(float(m["tokens"]) for m in sums)
    assert history[-1]["val_loss"] == pytest.approx(want, rel=1e-6)
    assert history[-1]["val_loss"] != history[-2]["val_loss"]  # the parameters moved


def sigterm(steps, batch):
    os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before it takes the machine
    return batch


def test_sigterm_saves_the_step_in_progress_and_the_run_resumes_from_it(base_run, tmp_path):
    cfg = _cfg(tmp_path / "run", steps=3, every=0)  # no periodic saves: only the preemption's (and the last)
    run, steps = _start(base_run, cfg, {2: sigterm})
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as err:
        train(cfg, run=run, log=lambda _: None)
    assert str(err.value) == ("preempted (SIGTERM): step 2 is saved and training stops. The last good checkpoint is "
                              f"step 2 at {run.checkpointer.dir / '2'}: the same command resumes from there")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler lives only while the steps run
    resumed, _ = _start(base_run, cfg, {})
    step, state, data = resumed.checkpointer.restore_latest(resumed.state, log=lambda _: None)
    assert step == 2
    _same(state, jax.device_get(run.state))  # what step 2 produced
    resumed.state = state
    resumed.data.restore(data)
    assert [m["step"] for m in train(cfg, run=resumed, log=lambda _: None)] == [3]
