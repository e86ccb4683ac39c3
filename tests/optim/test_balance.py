"""Aux-loss-free bias rule and sequence balance loss (spec model §5.3), against numpy and invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.moe import Routing
from dsv41_jax.optim import aux_free_bias_update, balance_loss, expert_load, router_bias_update, sequence_balance_loss

E, K = 8, 2
_seq_loss = jax.jit(sequence_balance_loss, static_argnums=2)


def _routing(rng, b=2, s=12, skew=None):
    scores = jnp.asarray(rng.uniform(0.1, 2.0, size=(b, s, E)), jnp.float32)
    experts = np.stack([rng.choice(E, K, replace=False, p=skew) for _ in range(b * s)]).reshape(b, s, K)
    return Routing(jnp.asarray(experts, jnp.int32), jnp.ones((b, s, K)), scores)


def test_bias_rule_matches_numpy(rng):
    r = _routing(rng, skew=np.arange(1, E + 1) / np.arange(1, E + 1).sum())
    bias = jnp.asarray(rng.normal(size=E), jnp.float32)
    load = np.bincount(np.asarray(r.experts).ravel(), minlength=E).astype(float)
    got = jax.jit(lambda b, e: aux_free_bias_update(b, expert_load(e, E), 1e-3))(bias, r.experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(bias) + 1e-3 * np.sign(load.mean() - load), rtol=1e-7)


def test_modalities_update_their_own_bias(rng):
    """Text tokens move ``bias`` only, image tokens ``bias_vl`` only; padding moves neither."""
    r = _routing(rng)
    is_image = jnp.asarray(rng.random((2, 12)) < 0.4)
    valid = jnp.ones((2, 12), bool).at[1, 8:].set(False)
    biases = {"layers": {0: {"ffn": {"gate": {"bias": jnp.zeros(E), "bias_vl": jnp.zeros(E)}}}}}
    new = jax.jit(lambda b, r, i, v: router_bias_update(b, [r], 1e-3, is_image=i, valid=v))(
        biases, r, is_image, valid)["layers"][0]["ffn"]["gate"]
    experts, img, ok = np.asarray(r.experts), np.asarray(is_image), np.asarray(valid)
    for key, sel in (("bias", ok & ~img), ("bias_vl", ok & img)):
        load = np.bincount(experts[sel].ravel(), minlength=E).astype(float)
        np.testing.assert_array_equal(np.asarray(new[key]), 1e-3 * np.sign(load.mean() - load).astype(np.float32))
    text_only = jax.jit(lambda b, r: router_bias_update(b, [r], 1e-3))(biases, r)["layers"][0]["ffn"]["gate"]
    assert (np.asarray(text_only["bias_vl"]) == 0).all()  # no image tokens: no image-bias step


def test_sequence_loss_matches_numpy(rng):
    r = _routing(rng)
    valid = jnp.ones((2, 12), bool).at[0, 9:].set(False)
    got = float(_seq_loss(r.scores, r.experts, 1e-4, valid))
    s, ex, v = np.asarray(r.scores, np.float64), np.asarray(r.experts), np.asarray(valid)
    per_seq = []
    for b in range(2):
        t = v[b].sum()
        f = E / (K * t) * np.bincount(ex[b][v[b]].ravel(), minlength=E)
        p = (s[b][v[b]] / s[b][v[b]].sum(-1, keepdims=True)).sum(0) / t
        per_seq.append((f * p).sum())
    assert got == pytest.approx(1e-4 * np.mean(per_seq), rel=1e-6)


def test_balanced_routing_gives_alpha_and_gradient_only_through_scores(rng):
    """With every expert picked equally often, f_i = 1 and Σ_i P_i = 1: the loss is exactly α per layer."""
    s = 4 * E // K
    experts = jnp.asarray(np.arange(s * K).reshape(1, s, K) % E, jnp.int32)
    scores = jnp.asarray(rng.uniform(0.1, 2.0, size=(1, s, E)), jnp.float32)
    r = Routing(experts, jnp.ones((1, s, K)), scores)
    assert float(jax.jit(balance_loss, static_argnums=1)([r, r], 1e-4)) == pytest.approx(2e-4, rel=1e-6)
    g = jax.jit(jax.grad(lambda sc: sequence_balance_loss(sc, experts, 1e-4)))(scores)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
