"""Faults around a run, on a toy state (no model, no compile): a failed background save, checksums, every
checkpoint damaged, a non-finite state, an unwritable or full checkpoint directory, the metrics log's one
timeline, and the non-finite guard's policy. The same faults in a real training run: test_fault_runs.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from fault_testing import read_only_directory

from dsv41_jax.config import ConfigError
from dsv41_jax.train.checkpoint import AllCheckpointsDamaged, RunCheckpointer, check_writable
from dsv41_jax.train.guard import NonFiniteConfig, NonFiniteGuard, TrainingStopped
from dsv41_jax.train.report import RunReport, truncate_metrics
from dsv41_jax.train.step import TrainState, keep_if_not_finite

STATE = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16),
         "n": jnp.asarray(7, jnp.int32)}


def _saved(tmp_path, steps=(1, 2), keep=5) -> RunCheckpointer:
    ck = RunCheckpointer(tmp_path, every=1, keep=keep)
    for s in steps:
        ck.save(s, jax.tree.map(lambda x, s=s: x + s, STATE), {"position": s}, {"note": "toy"})
    ck.wait()
    return ck


def _disk_full():
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_background_save_stops_at_the_next_step_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    ck = _saved(tmp_path, steps=(1,))
    assert ck.good == 1 and (ck.dir / "1" / "checksums.json").is_file()
    # the step's metadata file is written by Orbax's background thread, after save() has returned
    store = pytest.importorskip("orbax.checkpoint._src.metadata.checkpoint")._MetadataStoreImpl
    write = store.write
    monkeypatch.setattr(store, "write", lambda self, path, meta: _disk_full() if "/2." in str(path) else
                        write(self, path, meta))
    ck.save(2, STATE, {"position": 2}, {})  # returns: the failure happens in the background
    t0 = time.monotonic()
    with pytest.raises(TrainingStopped, match=r"saving checkpoint step 2 to .* failed \(.*No space left on device"):
        while True:  # what the loop does between steps
            ck.poll()
            assert time.monotonic() - t0 < 30, "the failed save was never reported"
    assert ck.good == 1
    ck.close()  # prompt: nothing left to wait for
    assert time.monotonic() - t0 < 30
    ck = RunCheckpointer(tmp_path, every=1, keep=5)
    step, state, data = ck.restore_latest(STATE, log=lambda _: None)
    assert (step, data) == (1, {"position": 1})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(STATE["w"]) + 1)
    ck.close()


def test_a_non_finite_state_is_never_saved(tmp_path):
    ck = RunCheckpointer(tmp_path, every=1, keep=1)
    bad = dict(STATE, w=STATE["w"].at[1, 2].set(jnp.nan))
    with pytest.raises(TrainingStopped, match="train state of step 3 holds NaN or inf values; it was not saved"):
        ck.save(3, bad, {}, {})
    ck.close()
    assert not list(ck.dir.iterdir())


def test_same_size_corruption_is_caught_by_the_checksums(tmp_path):
    ck = _saved(tmp_path)
    ck.close()
    biggest = max((p for p in (ck.dir / "2" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed
    biggest.write_bytes(bytes(raw))
    messages: list[str] = []
    ck = RunCheckpointer(tmp_path, every=1, keep=5)
    step, _, _ = ck.restore_latest(STATE, log=messages.append)
    ck.close()
    assert step == 1, messages
    rel = biggest.relative_to(ck.dir / "2")
    assert len(messages) == 1 and f"checkpoint step 2 at {ck.dir / '2'} is damaged ({rel} does not match the " \
        "checksum" in messages[0], messages


def test_a_non_finite_checkpoint_of_an_older_run_is_not_resumed_from(tmp_path):
    ck = _saved(tmp_path, steps=(1,))
    bad = dict(STATE, w=STATE["w"].at[0, 0].set(jnp.inf))
    ck.manager.save(2, args=ocp.args.Composite(  # as runs saved before non-finite states were refused
        state=ocp.args.StandardSave(bad), data=ocp.args.JsonSave({"process_count": 1, "processes": [{}]}),
        config=ocp.args.JsonSave({})))
    ck.close()
    messages: list[str] = []
    ck = RunCheckpointer(tmp_path, every=1, keep=5)
    step, _, _ = ck.restore_latest(STATE, log=messages.append)
    ck.close()
    assert step == 1 and "checkpoint step 2 at" in messages[0], messages
    assert "is damaged (it holds NaN or inf values (saved by a run that diverged))" in messages[0], messages


def _damage(step_dir):
    (step_dir / "state" / "_METADATA").unlink()


def test_every_checkpoint_damaged_is_refused_until_asked_to_start_fresh(tmp_path):
    ck = _saved(tmp_path)
    ck.close()
    for s in (1, 2):
        _damage(ck.dir / str(s))
    ck = RunCheckpointer(tmp_path, every=1, keep=5)
    with pytest.raises(AllCheckpointsDamaged) as err:
        ck.restore_latest(STATE, log=lambda _: None)
    msg = str(err.value)
    assert "every checkpoint in" in msg and "step 2: incomplete: state/_METADATA missing" in msg, msg
    assert "also damaged: step 1" in msg and "checkpoint.start_fresh=true" in msg and "\n" not in msg, msg
    assert sorted(p.name for p in ck.dir.iterdir()) == ["1", "2"]  # nothing moved: a rerun refuses again
    messages: list[str] = []
    assert ck.restore_latest(STATE, log=messages.append, start_fresh=True) is None
    ck.close()
    assert sorted(p.name for p in (tmp_path / "rejected_checkpoints").iterdir()) == ["1", "2"]
    assert "starting from step 0" in messages[-1], messages


def test_unwritable_or_full_checkpoint_directory_is_refused_before_training(tmp_path):
    with read_only_directory(tmp_path / "ro") as ro:
        with pytest.raises(ConfigError, match=r"checkpoint.dir: cannot write into .*ro/run \("):
            check_writable(ro / "run")
    ck = RunCheckpointer(tmp_path / "run", every=1, keep=3)
    huge = {"w": jax.ShapeDtypeStruct((1 << 40,), jnp.float32)}  # 4 TiB: more than any free space here
    with pytest.raises(ConfigError, match=r"MiB free, but one checkpoint of this run takes about 4,194,304.0 MiB"):
        ck.check_room(huge)
    ck.close()


# ----------------------------------------------------------------------------------------------------
# metrics


def _rows(steps) -> str:
    return "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in steps)


def test_resumed_metrics_keep_one_timeline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # an interrupted run logged 1..6 and died writing 7; a resume at 4 logged 5 again, then a torn line
    path.write_text(_rows(range(1, 7)) + '{"step": 7, "lo' + "\n" + _rows([5]) + '{"step": 6, "loss"')
    assert truncate_metrics(path, 5) == 4  # rows 5 (first copy), 6, the torn 7 and the torn tail
    assert path.read_text() == _rows(range(1, 6))
    report = RunReport(path, None, 10, 64, log=lambda _: None, progress=False, resumed=3)
    report.close()
    assert path.read_text() == _rows(range(1, 4))


def test_a_metrics_row_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "metrics.jsonl"
    report = RunReport(path, None, 10, 64, log=lambda _: None, progress=False)
    row = {"step": 1, "loss": 2.0, "ce": 2.0, "balance": 0.0, "grad_norm": 1.0, "lr": 1e-3, "imbalance": 1.0,
           "tokens_per_s": 1.0, "step_s": 1.0}
    report.record(row, 10)
    sink = report.sink

    class HalfFull:  # the disk takes half of the next row, then is full
        def write(self, data):
            sink.write(data[: len(data) // 2])
            sink.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(sink, name)

    report.sink = HalfFull()
    with pytest.raises(TrainingStopped, match=r"cannot write the metrics to .*metrics.jsonl \(No space left"):
        report.record(row | {"step": 2}, 10)
    report.sink = sink
    report.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


# ----------------------------------------------------------------------------------------------------
# the non-finite guard


def test_a_non_finite_update_is_not_applied():
    old = TrainState(jnp.asarray(4), {"w": jnp.ones(3)}, {"b": jnp.zeros(2)}, {"mu": jnp.full(3, 0.5)})
    new = TrainState(jnp.asarray(5), {"w": jnp.full(3, 2.0)}, {"b": jnp.ones(2)}, {"mu": jnp.full(3, jnp.nan)})
    for loss, grad_norm, want, skipped in [(1.0, 2.0, new, 0.0), (jnp.nan, 2.0, old, 1.0), (1.0, jnp.inf, old, 1.0)]:
        got, flag = keep_if_not_finite(new, old, jnp.asarray(loss), jnp.asarray(grad_norm))
        assert int(got.step) == 5 and float(flag) == skipped
        for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _metrics(loss, grad_norm=1.0):
    return {"loss": jnp.asarray(loss), "grad_norm": jnp.asarray(grad_norm),
            "skipped": jnp.asarray(float(not (np.isfinite(loss) and np.isfinite(grad_norm))))}


def test_guard_stops_at_the_first_non_finite_step():
    guard = NonFiniteGuard(NonFiniteConfig("stop"))
    guard.dispatched(1, _metrics(2.0))
    with pytest.raises(TrainingStopped, match=r"^step 2: loss is not finite \(loss nan, gradient norm 1\); the "
                       r"update was not applied and training stops \(nonfinite.action=stop\)"):
        guard.dispatched(2, _metrics(np.nan))
        guard.settle()


def test_guard_skips_a_bounded_number_of_batches():
    lines: list[str] = []
    guard = NonFiniteGuard(NonFiniteConfig("skip", max_skips=2), log=lines.append)
    for step, (loss, grad_norm) in enumerate([(2.0, 1.0), (np.inf, np.nan), (2.0, 1.0), (1.0, np.inf)], 1):
        guard.dispatched(step, _metrics(loss, grad_norm))
    guard.settle()
    assert lines == [
        "step 2: loss and gradient norm are not finite (loss inf, gradient norm nan): batch dropped, the state is "
        "unchanged (1 of at most 2, nonfinite.action=skip)",
        "step 4: gradient norm is not finite (loss 1, gradient norm inf): batch dropped, the state is unchanged "
        "(2 of at most 2, nonfinite.action=skip)"]
    with pytest.raises(TrainingStopped, match=r"step 5: .* 3 batches dropped in this run \(steps 2, 4, 5\), more "
                       r"than nonfinite.max_skips = 2"):
        guard.dispatched(5, _metrics(np.nan))
        guard.settle()


def test_read_only_helper_really_is_read_only(tmp_path):
    with read_only_directory(tmp_path / "ro") as ro:
        with pytest.raises(OSError):
            (ro / "x").write_text("x")
    shutil.rmtree(tmp_path / "ro", ignore_errors=True)
    assert not os.path.exists(tmp_path / "ro" / "x")
