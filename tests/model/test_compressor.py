"""CSA2 compressor (spec attention §3.3): m = 2 per-channel softmax pooling over each group's two tokens,
then RMSNorm; m = 1 a plain RMSNorm(x·Wᵀ). Oracle: float64 numpy, one group and one channel at a time.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model.compressor import Compressor

DIM, HEAD = 64, 64
EPS = 1e-20


def make(ratio, seed=0):
    comp = Compressor(DIM, HEAD, ratio, EPS, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 7)
    comp.norm.weight[...] = jnp.asarray(rng.uniform(0.2, 1.8, HEAD), jnp.float32)  # ones would hide a missing ⊙w
    if ratio > 1:
        # larger gate logits make the per-channel softmax far from uniform (a mean-pool would fail)
        comp.wgate.weight[...] = comp.wgate.weight[...] * 4.0
    return comp


def rms_norm(v, w, eps=EPS):
    v = np.asarray(v, np.float64)
    return w * v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)


def pool_oracle(x, wkv, wgate, norm_w):
    """Spec §3.3 m = 2: for group j (tokens 2j, 2j+1) and channel d, α = e^{z_a}/(e^{z_a}+e^{z_b})."""
    b, s, _ = x.shape
    t = s // 2
    out = np.zeros((b, t, wkv.shape[0]))
    for bi in range(b):
        for j in range(t):
            xa, xb = x[bi, 2 * j].astype(np.float64), x[bi, 2 * j + 1].astype(np.float64)
            ca, cb = wkv @ xa, wkv @ xb
            za, zb = wgate @ xa, wgate @ xb
            p = np.zeros(wkv.shape[0])
            for d in range(wkv.shape[0]):
                top = max(za[d], zb[d])
                ea, eb = np.exp(za[d] - top), np.exp(zb[d] - top)
                alpha = ea / (ea + eb)
                p[d] = alpha * ca[d] + (1 - alpha) * cb[d]
            out[bi, j] = rms_norm(p, norm_w)
    return out


def weights(comp):
    return (np.asarray(comp.wkv.weight[...], np.float64), np.asarray(comp.wgate.weight[...], np.float64),
            np.asarray(comp.norm.weight[...], np.float64))


@pytest.mark.parametrize("s", [8, 9])
def test_ratio2_equals_per_channel_softmax_pool(rng, s):
    comp = make(2)
    x = rng.normal(0, 1.0, (2, s, DIM)).astype(np.float32)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(comp, jnp.asarray(x)))
    assert got.shape == (2, s // 2, HEAD)
    wkv, wgate, norm_w = weights(comp)
    want = pool_oracle(x, wkv, wgate, norm_w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the gate really is per channel and non-trivial: α spans (0, 1) widely on this input
    z = np.einsum("bsd,hd->bsh", x[:, : 2 * (s // 2)].astype(np.float64), wgate).reshape(2, s // 2, 2, HEAD)
    alpha = 1 / (1 + np.exp(z[:, :, 1] - z[:, :, 0]))
    assert alpha.min() < 0.05 and alpha.max() > 0.95


def test_ratio2_trailing_token_has_no_entry_and_no_influence(rng):
    comp = make(2, seed=1)
    fun = nnx.jit(lambda m, x: m(x))
    x = rng.normal(0, 1.0, (1, 11, DIM)).astype(np.float32)
    full = np.asarray(fun(comp, jnp.asarray(x)))
    assert full.shape == (1, 5, HEAD)
    even = np.asarray(fun(comp, jnp.asarray(x[:, :10])))
    np.testing.assert_array_equal(full, even)
    x2 = x.copy()
    x2[:, 10] = rng.normal(0, 100.0, DIM)  # the open group's token changes nothing
    np.testing.assert_array_equal(np.asarray(fun(comp, jnp.asarray(x2))), full)
    # and each closed group depends only on its own two tokens
    x3 = x.copy()
    x3[:, 4] += 1.0  # group 2
    changed = np.abs(np.asarray(fun(comp, jnp.asarray(x3))) - full).max(-1)[0]
    assert changed[2] > 0 and (changed[[0, 1, 3, 4]] == 0).all()


def test_ratio1_is_rmsnorm_of_projection(rng):
    comp = make(1, seed=2)
    assert not hasattr(comp, "wgate")
    x = rng.normal(0, 3.0, (2, 7, DIM)).astype(np.float32)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(comp, jnp.asarray(x)))
    wkv = np.asarray(comp.wkv.weight[...], np.float64)
    norm_w = np.asarray(comp.norm.weight[...], np.float64)
    want = rms_norm(np.einsum("bsd,hd->bsh", x.astype(np.float64), wkv), norm_w)
    assert got.shape == (2, 7, HEAD)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
