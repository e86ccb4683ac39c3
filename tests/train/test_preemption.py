"""A SIGTERM (what a scheduler sends before it takes the machine) during ``train.loop.train``: the step in
progress is saved, the run stops with :class:`Preempted`, and the same run resumed from that save goes on to
the end. The tiny run's real jitted step (the session's ``tiny_run``)."""

from __future__ import annotations

import dataclasses
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.data.pipeline import DataState
from dsv41_jax.train.checkpoint import RunCheckpointer
from dsv41_jax.train.config import CheckpointConfig
from dsv41_jax.train.guard import Preempted
from dsv41_jax.train.loop import train


def _run(tiny_run, run_dir, on_step: dict):
    run, fresh = tiny_run
    cfg = run.cfg.replace(steps=3, checkpoint=CheckpointConfig(str(run_dir), every=0, keep=2),
                          logging=dataclasses.replace(run.cfg.logging, tensorboard=None))

    def step_fn(state, batch):
        on_step.get(int(state.step) + 1, lambda: None)()
        return run.step_fn(state, batch)

    return dataclasses.replace(run, cfg=cfg, state=jax.tree.map(jnp.copy, fresh), step_fn=step_fn,
                               checkpointer=RunCheckpointer(run_dir, 0, 2), data=DataState(iter(run.dataset)))


def test_sigterm_saves_the_step_in_progress_and_the_run_resumes_from_it(tiny_run, tmp_path):
    run = _run(tiny_run, tmp_path, {2: lambda: os.kill(os.getpid(), signal.SIGTERM)})
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as err:  # every=0: no save but the preemption's (and the last)
        train(run.cfg, run=run, log=lambda _: None)
    assert str(err.value) == ("preempted (SIGTERM): step 2 is saved and training stops. The last good checkpoint is "
                              f"step 2 at {run.checkpointer.dir / '2'}: the same command resumes from there")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler lives only while the steps run
    resumed = _run(tiny_run, tmp_path, {})
    step, state, data = resumed.checkpointer.restore_latest(resumed.state, log=lambda _: None)
    assert step == 2
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(run.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # what step 2 produced
    resumed.state = state
    resumed.data.restore(data)
    assert [m["step"] for m in train(resumed.cfg, run=resumed, log=lambda _: None)] == [3]
