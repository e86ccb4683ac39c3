"""Engram module forward (spec model §6.6) against a float64 numpy loop over tokens and streams."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model.engram import Engram

DIM, M, ROWS = 64, 4, 50
EPS = 1e-20


def make(tiny_cfg, seed=0):
    eng = Engram(tiny_cfg.engram, ROWS, DIM, M, EPS, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 11)
    # q/k weights start at ones, which would hide a dropped or misapplied per-stream weight
    eng.q_weight[...] = jnp.asarray(rng.normal(1.0, 0.6, (M, DIM)), jnp.float32)
    eng.k_weight[...] = jnp.asarray(rng.normal(1.0, 0.6, (M, DIM)), jnp.float32)
    return eng


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def engram_oracle(eng, x, rows, dead=None):
    table = np.asarray(eng.embed.weight[...], np.float64)
    wkv = np.asarray(eng.wkv.weight[...], np.float64)
    w = np.asarray(eng.q_weight[...], np.float64) * np.asarray(eng.k_weight[...], np.float64)
    b, s, m, d = x.shape
    out = np.zeros((b, s, m, d))
    gates = np.zeros((b, s, m))
    for bi in range(b):
        for si in range(s):
            e = np.concatenate([table[r] for r in rows[bi, si]])  # column-major flatten [C·H]
            kv = wkv @ e
            val = kv[m * d:]  # one value shared by every stream
            for c in range(m):
                key = kv[c * d:(c + 1) * d]
                h = x[bi, si, c].astype(np.float64)
                rho = 1 / np.sqrt(np.mean(h * h) + EPS) / np.sqrt(np.mean(key * key) + EPS)
                dot = np.sum(h * w[c] * key) * rho / np.sqrt(d)
                g = sigmoid(np.sign(dot) * np.sqrt(max(abs(dot), 1e-6)))
                if dead is not None and dead[bi, si]:
                    g = 0.0
                gates[bi, si, c] = g
                out[bi, si, c] = h + g * val
    return out, gates


def inputs(rng, tiny_cfg, b=2, s=7):
    # streams of very different scale: a norm joint over streams (instead of per stream) would fail
    x = (rng.normal(0, 1.0, (b, s, M, DIM)) * np.array([0.05, 1.0, 4.0, 30.0])[:, None]).astype(np.float32)
    rows = rng.integers(0, ROWS, (b, s, tiny_cfg.engram.n_columns)).astype(np.int32)
    return x, rows


def test_engram_equals_spec(tiny_cfg, rng):
    eng = make(tiny_cfg)
    assert tiny_cfg.engram.n_columns == 6 and eng.embed.weight.shape == (ROWS, tiny_cfg.engram.head_dim)
    x, rows = inputs(rng, tiny_cfg)
    got = np.asarray(nnx.jit(lambda m, x, r: m(x, r))(eng, jnp.asarray(x), jnp.asarray(rows)))
    want, gates = engram_oracle(eng, x, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want - x).max())
    # the data exercises both signs of the signed square root and gates far from 1/2
    assert gates.min() < 0.3 and gates.max() > 0.7


def test_engram_dead_positions_are_untouched(tiny_cfg, rng):
    eng = make(tiny_cfg, seed=1)
    x, rows = inputs(rng, tiny_cfg, s=9)
    dead = rng.random((2, 9)) < 0.4
    dead[0, 0], dead[0, 1] = True, False
    got = np.asarray(nnx.jit(lambda m, x, r, d: m(x, r, d))(eng, jnp.asarray(x), jnp.asarray(rows),
                                                            jnp.asarray(dead)))
    np.testing.assert_array_equal(got[dead], x[dead])  # gate 0: the input streams exactly
    want, _ = engram_oracle(eng, x, rows, dead)
    np.testing.assert_allclose(got[~dead], want[~dead], rtol=1e-5, atol=1e-5 * np.abs(want - x).max())
    assert np.abs(got[~dead] - x[~dead]).min(axis=-1).max() > 0


def test_engram_gate_is_per_stream_scale_invariant(tiny_cfg, rng):
    """ρ normalises each (token, stream) separately: scaling one stream scales only its own residual,
    the added Engram term (gate · value) stays the same."""
    eng = make(tiny_cfg, seed=2)
    x, rows = inputs(rng, tiny_cfg, b=1, s=5)
    fun = nnx.jit(lambda m, x, r: m(x, r))
    base = np.asarray(fun(eng, jnp.asarray(x), jnp.asarray(rows))) - x
    x2 = x.copy()
    x2[:, :, 2] *= np.float32(256.0)  # a power of two keeps the scaling exact
    delta = np.asarray(fun(eng, jnp.asarray(x2), jnp.asarray(rows))) - x2
    np.testing.assert_allclose(delta[:, :, [0, 1, 3]], base[:, :, [0, 1, 3]], rtol=0, atol=0)
    # stream 2's own residual grew 256-fold, so compare its added term relative to that
    np.testing.assert_allclose(delta[:, :, 2], base[:, :, 2], rtol=0, atol=1e-5 * np.abs(x2[:, :, 2]).max())
