"""The training loop on one CPU: the loss falls on a fixed batch, and a run resumed from an Orbax checkpoint
(state + router biases + optimizer + data iterator) continues to the same losses as an uninterrupted run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.data.pipeline import DataState


def copy_state(state):
    return jax.tree.map(jnp.copy, state)  # the step donates its input state


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_loss_decreases_on_a_fixed_batch(tiny_run):
    run, fresh = tiny_run
    batch = run.next_batch(DataState(iter(run.dataset)))
    state, losses, biases0 = copy_state(fresh), [], jax.tree.leaves(fresh.biases)
    for _ in range(5):
        state, m = run.step_fn(state, batch)
        losses.append(float(m["loss"]))
        assert np.isfinite(float(m["grad_norm"])) and float(m["balance"]) > 0
    assert np.all(np.diff(losses) < 0), losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert int(state.step) == 5
    # the aux-loss-free rule moved the text biases only (no image tokens), spec model §5.3
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
             zip(jax.tree.leaves(state.biases), biases0, strict=True)]
    assert max(moved) > 0


def _losses(run, state, data, n):
    out = []
    for _ in range(n):
        state, m = run.step_fn(state, run.next_batch(data))
        out.append(float(m["loss"]))
    return state, out


def test_resume_continues_the_same_run(tiny_run):
    run, fresh = tiny_run
    ck = run.checkpointer
    data = DataState(iter(run.dataset))
    state, first = _losses(run, copy_state(fresh), data, 2)
    ck.save(2, state, data.state(), {"note": "test"})
    ck.manager.wait_until_finished()
    _, want = _losses(run, state, data, 3)  # the uninterrupted run

    resumed_data = DataState(iter(run.dataset))  # a new process would start here
    restored, data_state = ck.restore(ck.latest_step(), fresh)
    resumed_data.restore(data_state)
    assert int(restored.step) == 2
    _, got = _losses(run, restored, resumed_data, 3)
    assert got == want, (first, want, got)  # fp32 on CPU: bitwise the same steps
