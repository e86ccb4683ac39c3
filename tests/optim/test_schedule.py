"""The learning-rate schedule of spec model §9.4 at its corner steps."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.optim import OptimConfig, lr_at, lr_schedule

CFG = OptimConfig()


def test_corner_steps():
    c = CFG
    mid = (c.constant_until + c.decay_until) // 2
    want = {
        0: c.lr / c.warmup_steps,  # the first update already moves (warm-up reaches the peak at its last step)
        c.warmup_steps // 2 - 1: c.lr / 2,
        c.warmup_steps - 1: c.lr,
        c.warmup_steps: c.lr,
        c.constant_until - 1: c.lr,
        c.constant_until: c.lr,  # cosine starts at the peak: continuous
        mid: c.lr_floor + (c.lr - c.lr_floor) * 0.5 * (1 + math.cos(math.pi * (mid - c.constant_until)
                                                                   / (c.decay_until - c.constant_until))),
        c.decay_until: c.lr_floor,
        c.total_steps: c.lr_floor,
    }
    got = jax.jit(jax.vmap(lambda t: lr_at(t, c)))(jnp.asarray(list(want)))
    np.testing.assert_allclose(np.asarray(got), list(want.values()), rtol=2e-6)


def test_monotone_pieces_and_optax_schedule():
    steps = np.arange(0, CFG.total_steps + 1, 97)
    lr = np.asarray(jax.jit(jax.vmap(lr_schedule(CFG)))(jnp.asarray(steps)))
    warm, decay = steps < CFG.warmup_steps, steps >= CFG.constant_until
    assert (np.diff(lr[warm]) > 0).all() and (np.diff(lr[decay]) <= 1e-12).all()
    assert lr.max() == pytest.approx(CFG.lr) and lr.min() == pytest.approx(CFG.lr / CFG.warmup_steps)


def test_step_counts_come_from_the_token_budget():
    """28 T, 40 T, 45 T tokens at 100.6 M tokens a step (spec §9.4)."""
    per_step = 100.6e6
    assert (CFG.constant_until, CFG.decay_until, CFG.total_steps) == tuple(
        int(t / per_step) for t in (28e12, 40e12, 45e12))
