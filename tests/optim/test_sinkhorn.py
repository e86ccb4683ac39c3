"""Sinkhorn-balanced momentum (spec model §9.3, Algorithm 1) against a literal numpy loop, and its invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
from optim_testing import run_steps

from dsv41_jax.optim import OptimConfig, sinkhorn, sinkhorn_direction

CFG = OptimConfig()
LR = 1e-2
_direction = jax.jit(sinkhorn_direction, static_argnames=("tau", "iters", "eps"))


def _table_grad(rng, rows=96, cols=40):
    """A gradient shaped like an embedding's: unseen rows exactly 0, a few tiny rows, rows of mixed scale."""
    g = rng.normal(size=(rows, cols)) * rng.lognormal(0, 1, size=(rows, 1))
    g[rng.random(rows) < 0.3] = 0.0
    g[:3] *= 1e-6  # below τ·mean row norm: masked
    return g


def _direction_of(n, iters=CFG.sinkhorn_iters):
    return np.asarray(_direction(jnp.asarray(n, jnp.float32), tau=CFG.sinkhorn_tau, iters=iters, eps=CFG.sinkhorn_eps))


def test_two_steps_match_numpy(rng):
    for lr_mult in (1.0, CFG.engram_lr_mult):
        w, g1, g2 = rng.normal(size=(96, 40)), _table_grad(rng), _table_grad(rng)
        params, state = run_steps(sinkhorn(CFG, lr_mult, lr=LR), {"t": w}, [{"t": g1}, {"t": g2}])
        want, m = ref.sinkhorn_step(w, g1, np.zeros_like(w), lr=LR, lr_mult=lr_mult)
        want, m = ref.sinkhorn_step(want, g2, m, lr=LR, lr_mult=lr_mult)
        np.testing.assert_allclose(params["t"], want, atol=2e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(state[0].momentum["t"]), m, rtol=1e-6, atol=1e-7)


def test_rows_unit_rms_and_columns_converge(rng):
    """K = 11 ends on a row step: every kept row of Δ has RMS exactly 1. Columns then carry equal norms up to
    the not-yet-converged residual, which shrinks with K."""
    n = _table_grad(rng, 200, 48)
    delta = _direction_of(n)
    kept = np.linalg.norm(n, axis=1) > CFG.sinkhorn_tau * np.linalg.norm(n, axis=1).mean()
    row_rms = np.sqrt((delta**2).mean(axis=1))
    np.testing.assert_allclose(row_rms[kept], 1.0, atol=1e-6)
    assert (delta[~kept] == 0).all()

    def column_spread(d):
        cols = np.linalg.norm(d, axis=0)
        return cols.std() / cols.mean()

    spreads = [column_spread(_direction_of(n, k)) for k in (1, 3, 11, 41)]
    assert spreads == sorted(spreads, reverse=True), spreads
    assert spreads[2] < 2e-3 and spreads[3] < 1e-5, spreads


def test_mask_uses_the_mean_over_all_rows(rng):
    """ρ̄ includes zero rows: with 90 % of rows empty, a row at 5·τ·(mean over non-empty rows) is still kept
    (it is 50·τ·ρ̄), and one at 0.5·τ·ρ̄ is dropped."""
    n = np.zeros((100, 16))
    n[:10] = rng.normal(size=(10, 16))
    rho = np.linalg.norm(n, axis=1)
    n[10] = n[0] / rho[0] * 5 * CFG.sinkhorn_tau * rho[:10].mean()
    n[11] = n[0] / rho[0] * 0.5 * CFG.sinkhorn_tau * np.linalg.norm(n, axis=1).mean()
    delta = _direction_of(n)
    assert np.abs(delta[10]).sum() > 0 and (delta[11] == 0).all() and (delta[12:] == 0).all()


def test_no_weight_decay_and_zero_gradient_is_a_no_op(rng):
    tx = sinkhorn(CFG, lr=LR)
    params = {"t": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}
    upd, _ = tx.update({"t": jnp.zeros((32, 8))}, tx.init(params), params)
    assert np.isfinite(np.asarray(upd["t"])).all() and (np.asarray(upd["t"]) == 0).all()


def test_empty_columns_stay_finite(rng):
    """A feature no row uses would push its column scale to 1/ε per step (overflow, then 0·inf): it must not."""
    n = rng.normal(size=(64, 12))
    n[:, 5] = 0.0
    delta = _direction_of(n)
    assert np.isfinite(delta).all() and (delta[:, 5] == 0).all()
    want, _ = ref.sinkhorn_step(np.zeros_like(n), n, np.zeros_like(n), lr=-1.0, beta=0.0, gamma=1.0)
    np.testing.assert_allclose(delta, want, atol=2e-6)
