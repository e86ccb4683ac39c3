"""Muon (spec model §9.2): per matrix, per head, per ``wo_a`` group and per expert, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import optax
import pytest
from optim_testing import run_steps

from dsv41_jax.optim import OptimConfig, muon, newton_schulz
from dsv41_jax.optim.muon import orthogonalized_update

CFG = OptimConfig(ns_dtype="float32")  # the numpy reference is exact; bf16 is tested against it apart
LR = 2e-3
_ns = jax.jit(lambda d: newton_schulz(d, CFG.ns_schedule, CFG.ns_eps))
_orth = jax.jit(orthogonalized_update, static_argnames=("blocks", "schedule", "rms", "eps"))


def _steps(tx, w, grads):
    """Apply ``tx`` for each gradient in turn; returns the final weights."""
    return run_steps(tx, {"w": w}, [{"w": g} for g in grads])[0]["w"]


def test_newton_schulz_matches_numpy(rng):
    for shape in [(48, 80), (80, 48), (3, 40, 24)]:
        d = rng.normal(size=shape)
        got = np.asarray(_ns(jnp.asarray(d, jnp.float32)))
        want = np.stack([ref.newton_schulz(x) for x in d.reshape(-1, *shape[-2:])]).reshape(shape)
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=str(shape))


def test_newton_schulz_singular_values_follow_the_scalar_polynomial(rng):
    """NS maps each singular value σ of X₀ = D/‖D‖_F to p(σ) (the composed per-iteration quintics); with the
    8 + 2 schedule every σ ≥ 1e-3 lands in [1, 1.00054] (the band of p over [1e-3, 1])."""
    grid = np.logspace(-3, 0, 100_001)
    band = ref.ns_scalar(grid)
    lo, hi = band.min(), band.max()
    assert 0.99999 < lo and hi < 1.00054
    for shape in [(64, 160), (160, 64), (96, 96)]:
        k = min(shape)
        u, _ = np.linalg.qr(rng.normal(size=(shape[0], k)))
        v, _ = np.linalg.qr(rng.normal(size=(shape[1], k)))
        d = (u * np.geomspace(1.0, 100.0, k)) @ v.T  # a spectrum spread over two decades
        sigma_in = np.linalg.svd(d / np.linalg.norm(d), compute_uv=False)
        assert sigma_in.min() > 1e-3
        out = np.asarray(_ns(jnp.asarray(d, jnp.float32)), np.float64)
        sigma_out = np.linalg.svd(out, compute_uv=False)
        # p is not monotone near 1, so compare the sorted values
        np.testing.assert_allclose(np.sort(sigma_out), np.sort(ref.ns_scalar(sigma_in)), atol=2e-5)
        assert lo - 2e-5 <= sigma_out.min() and sigma_out.max() <= hi + 2e-5


def test_bf16_newton_schulz_stays_near_fp32(rng):
    """The recipe's bf16 iteration (``ns_dtype``, the default): every singular value still lands within 1 % of
    1 (fp32: within 0.054 %), and the direction is within ~2 % of fp32's (observed 1.7–1.9 %: bf16 keeps 8
    significant bits through 10 iterations)."""
    for shape in [(64, 160), (160, 64), (4, 96, 96)]:
        d = jnp.asarray(rng.normal(size=shape), jnp.float32)
        exact = np.asarray(_ns(d), np.float64)
        bf16 = jax.jit(lambda d: newton_schulz(d, CFG.ns_schedule, CFG.ns_eps, "bfloat16"))(d)
        assert bf16.dtype == jnp.float32  # the iteration's dtype stays inside
        bf16 = np.asarray(bf16, np.float64)
        sigma = np.linalg.svd(bf16, compute_uv=False)
        assert 0.99 < sigma.min() and sigma.max() < 1.01, (shape, sigma.min(), sigma.max())
        assert np.linalg.norm(bf16 - exact) / np.linalg.norm(exact) < 0.03, shape
    assert OptimConfig().ns_dtype == "bfloat16"


# name: (shape [*E, rows, cols], blocks) with tiny-config shapes
CASES = {
    "matrix (attn.wq_a)": ((64, 48), 1),
    "q heads (attn.wq_b, 4 × [64, 64])": ((256, 64), 4),
    "index heads (indexer.wq_b, 16 × [64, 64])": ((1024, 64), 16),
    "wo_a groups (2 × [32, 128])": ((64, 128), 2),
    "routed experts (8 × [64, 48])": ((8, 64, 48), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_muon_two_steps_match_numpy(case, rng):
    shape, blocks = CASES[case]
    w, g1, g2 = (rng.normal(size=shape) * s for s in (0.05, 1.0, 1.0))
    got = _steps(muon(CFG, blocks, lr=LR), w, [g1, g2])
    want, m = ref.muon_step(w, g1, np.zeros(shape), lr=LR, blocks=blocks)
    want, _ = ref.muon_step(want, g2, m, lr=LR, blocks=blocks)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert np.abs(got - w).max() > 1e-4  # the step is far above the tolerance


def test_each_head_is_orthogonalised_on_its_own(rng):
    """Per-head: every [H, q_lora] block of the update has all singular values ≈ rms·sqrt(max(H, q_lora));
    orthogonalising the whole [N·H, q_lora] matrix instead does not give that."""
    n, h, r = 4, 32, 48
    d = jnp.asarray(rng.normal(size=(n * h, r)) * np.repeat(np.array([0.1, 1, 3, 10]), h)[:, None], jnp.float32)
    o = np.asarray(_orth(d, blocks=n, schedule=CFG.ns_schedule, rms=1.0, eps=CFG.ns_eps))
    for i in range(n):
        s = np.linalg.svd(o[i * h:(i + 1) * h], compute_uv=False) / np.sqrt(r)
        np.testing.assert_allclose(s, 1.0, atol=1e-3)
    whole = np.asarray(_orth(d, blocks=1, schedule=CFG.ns_schedule, rms=1.0, eps=CFG.ns_eps))
    assert np.linalg.norm(whole[:h]) < 0.5 * np.linalg.norm(whole[-h:])  # heads share one spectrum there


def test_zero_gradient_gives_pure_weight_decay():
    """The indexer gets no LM-loss gradient: its Muon direction must be 0 (no NaN), leaving decoupled decay."""
    w = np.full((16, 8), 0.5)
    got = _steps(muon(CFG, 1, lr=LR), w, [np.zeros_like(w)] * 2)
    np.testing.assert_allclose(got, w * (1 - LR * CFG.weight_decay) ** 2, rtol=1e-6)


def test_optax_contrib_momentum_is_not_the_specs(rng):
    """Why the momentum is ours: optax.contrib.scale_by_muon (EMA with bias correction) gives the spec's
    direction at step 1 but not at step 2, while its orthogonaliser is the one we reuse."""
    shape = (32, 48)
    g1, g2 = rng.normal(size=shape), rng.normal(size=shape)
    theirs = optax.contrib.scale_by_muon(ns_coeffs=CFG.ns_schedule, ns_steps=len(CFG.ns_schedule), beta=0.95,
                                         eps=CFG.ns_eps, nesterov=True,
                                         weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers()})
    ours = muon(CFG, 1, lr=1.0)
    outs = []
    for tx, scale in ((theirs, 1.0), (ours, -1.0)):
        params = {"w": jnp.zeros(shape)}
        state = tx.init(params)
        steps = []
        for g in (g1, g2):
            upd, state = jax.jit(tx.update)({"w": jnp.asarray(g, jnp.float32)}, state, params)
            steps.append(np.asarray(upd["w"]) * scale)
        outs.append(steps)
    (t1, t2), (o1, o2) = outs
    unit = lambda x: x / np.linalg.norm(x)
    np.testing.assert_allclose(unit(t1), unit(o1), atol=1e-5)  # step 1: both ∝ NS(G₁)
    assert np.abs(unit(t2) - unit(o2)).max() > 1e-3  # step 2: different momentum/gradient mix


def test_leaves_of_one_shape_are_orthogonalised_together_as_apart(rng):
    """``scale_by_muon`` stacks leaves of one shape and dtype (one per layer in the model) into one batched
    Newton–Schulz: the same directions as leaf by leaf, in fp32 and bf16, with every leaf's own result; and
    the step's products are one batch per shape (a tree of 6 leaves of 3 shapes: 3 groups)."""
    from dsv41_jax.optim.muon import stacked_by_shape

    shapes = [(48, 80), (48, 80), (3, 40, 24), (80, 48), (48, 80), (3, 40, 24)]
    tree = {f"l{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    for ns_dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):
        fn = lambda d, ns_dtype=ns_dtype: orthogonalized_update(  # noqa: E731
            d, blocks=1, schedule=CFG.ns_schedule, rms=CFG.muon_rms, eps=CFG.ns_eps, ns_dtype=ns_dtype)
        together = jax.jit(lambda t, fn=fn: stacked_by_shape(fn, t))(tree)
        for name, x in tree.items():
            apart = jax.jit(fn)(x)
            assert together[name].shape == x.shape
            err = np.linalg.norm(np.asarray(together[name]) - np.asarray(apart)) / np.linalg.norm(np.asarray(apart))
            assert err < tol, (name, ns_dtype, err)
    calls = []
    stacked_by_shape(lambda x: calls.append(x.shape) or x, tree)
    assert sorted(calls) == [(2, 3, 40, 24), (3, 48, 80), (80, 48)]
