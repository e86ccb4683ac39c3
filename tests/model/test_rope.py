"""RoPE / YaRN against explicit formulas (spec attention §4).

Oracles: the YaRN table is written out per pair index k in float64; the rotation is done with numpy
complex numbers on the interleaved (2k, 2k+1) lane pairs of the trailing rope slice.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import AttentionConfig
from dsv41_jax.model.rope import apply_rope, rope_frequencies, yarn_bounds

# one float32 ulp is 2^-23 relative; the library builds the table with fp32 pow/divide (as the reference
# does), so up to two roundings separate it from the float64 formula
FREQ_RTOL = 2.5e-7

apply_rope_jit = jax.jit(apply_rope, static_argnames=("heads", "inverse"))


def release_cfg() -> AttentionConfig:
    return AttentionConfig()


def rope(x, pos, freqs, *, heads, inverse=False):
    return np.asarray(apply_rope_jit(jnp.asarray(x), jnp.asarray(pos), freqs, heads=heads, inverse=inverse))


def complex_rope_oracle(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, heads: bool,
                        inverse: bool = False) -> np.ndarray:
    """Rotate lane pairs (H−rd+2k, H−rd+2k+1) as the complex number a + ib by e^{±i·pos·f_k} (float64)."""
    rd = 2 * len(freqs)
    x = np.asarray(x, np.float64)
    tail = x[..., x.shape[-1] - rd:]
    z = tail[..., 0::2] + 1j * tail[..., 1::2]
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(freqs, np.float64)
    if heads:
        ang = ang[..., None, :]
    z = z * np.exp((-1j if inverse else 1j) * ang)
    out = x.copy()
    out[..., x.shape[-1] - rd::2] = z.real
    out[..., x.shape[-1] - rd + 1::2] = z.imag
    return out


def angle_atol(x, pos, freqs) -> float:
    """Error budget of an fp32 rotation: the angle pos·f is rounded once in fp32 (≤ |pos·f|·2^-24 rad),
    which moves a lane pair of norm r by ≤ r times that; plus a few ulps of the fp32 products."""
    ang = float(np.max(pos)) * float(np.max(freqs))
    r = float(np.abs(x).max()) * math.sqrt(2)
    return r * (ang * 2.0**-24 * 2 + 1e-6)


# --------------------------------------------------------------------------------------------------
# frequency tables


def test_yarn_bounds_release():
    cfg = release_cfg()
    assert (cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len) == (64, 160000.0, 65536)
    assert (cfg.beta_fast, cfg.beta_slow, cfg.rope_factor) == (32.0, 1.0, 16.0)
    # the correction dims themselves (spec: cd(32) = 15.45, cd(1) = 24.71)
    cd = lambda r: 64 * math.log(65536 / (2 * math.pi * r)) / (2 * math.log(160000.0))
    assert cd(32) == pytest.approx(15.45, abs=5e-3) and cd(1) == pytest.approx(24.71, abs=5e-3)
    low, high = yarn_bounds(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.beta_fast,
                            cfg.beta_slow)
    assert (low, high) == (15, 25)


def test_yarn_bounds_clamped():
    # original length 100 < 2π·32 makes cd(32) negative (low clamps to 0); cd(1) = 1.20 → high 2
    assert yarn_bounds(8, 10000.0, 100, 32, 1) == (0, 2)
    # θ = 2 makes cd(1) = 8·ln(65536/2π)/(2 ln 2) ≈ 53 > dim − 1: high clamps to 7 (low = ⌊33.4⌋)
    assert yarn_bounds(8, 2.0, 65536, 32, 1) == (33, 7)


def test_plain_frequencies_have_no_yarn():
    cfg = release_cfg()
    f = rope_frequencies(cfg, "plain")
    assert f.dtype == np.float32 and f.shape == (32,)
    k = np.arange(32)
    want = 10000.0 ** (-2.0 * k / 64)  # θ = rope_theta = 1e4, no interpolation on any pair
    np.testing.assert_allclose(f, want, rtol=FREQ_RTOL, atol=0)


def test_yarn_frequencies_explicit():
    cfg = release_cfg()
    f = rope_frequencies(cfg, "yarn")
    assert f.dtype == np.float32 and f.shape == (32,)
    want = np.empty(32)
    for k in range(32):
        base = 160000.0 ** (-2.0 * k / 64)
        if k <= 15:
            want[k] = base
        elif k >= 25:
            want[k] = base / 16.0
        else:
            t = (k - 15) / (25 - 15)
            want[k] = (1 - t) * base + t * base / 16.0
    np.testing.assert_allclose(f, want, rtol=FREQ_RTOL, atol=0)
    # the blend really happens: pair 20 sits strictly between the kept and the divided frequency
    b20 = 160000.0 ** (-40 / 64)
    assert b20 / 16 < f[20] < b20


def test_tiny_yarn_uses_its_own_bounds(tiny_cfg):
    a = tiny_cfg.attention
    f = rope_frequencies(a, "yarn")
    d = a.rope_head_dim
    low, high = yarn_bounds(d, a.compress_rope_theta, a.original_seq_len, a.beta_fast, a.beta_slow)
    want = []
    for k in range(d // 2):
        base = a.compress_rope_theta ** (-2.0 * k / d)
        t = min(max((k - low) / max(high - low, 1e-3), 0.0), 1.0)
        want.append((1 - t) * base + t * base / a.rope_factor)
    np.testing.assert_allclose(f, want, rtol=FREQ_RTOL, atol=0)


# --------------------------------------------------------------------------------------------------
# rotation


@pytest.mark.parametrize("kind", ["plain", "yarn"])
def test_rotation_matches_complex_oracle_heads(rng, kind):
    cfg = release_cfg()
    freqs = rope_frequencies(cfg, kind)
    b, s, n, h = 2, 7, 3, 96  # 96 lanes: only the trailing 64 rotate
    x = rng.standard_normal((b, s, n, h)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(b, s))
    got = rope(x, pos, freqs, heads=True)
    want = complex_rope_oracle(x, pos, freqs, heads=True)
    np.testing.assert_array_equal(got[..., :h - 64], x[..., :h - 64])  # leading lanes untouched, bitwise
    np.testing.assert_allclose(got, want, rtol=0, atol=angle_atol(x, pos, freqs))


def test_rotation_matches_complex_oracle_small_positions(rng):
    # small positions keep the fp32 angle error negligible, so the rotation is checked to ~1e-6
    cfg = release_cfg()
    freqs = rope_frequencies(cfg, "yarn")
    x = rng.standard_normal((3, 11, 64 + 32)).astype(np.float32)
    pos = rng.integers(0, 40, size=(3, 11))
    got = rope(x, pos, freqs, heads=False)
    want = complex_rope_oracle(x, pos, freqs, heads=False)
    np.testing.assert_array_equal(got[..., :32], x[..., :32])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_rotation_pairs_are_interleaved():
    # a unit vector on the first lane of pair k must move only into the second lane of that same pair
    cfg = release_cfg()
    freqs = rope_frequencies(cfg, "plain")
    h = 80
    for k in (0, 5, 31):
        x = np.zeros((1, 1, h), np.float32)
        x[..., h - 64 + 2 * k] = 1.0
        p = 3
        got = rope(x, np.array([[p]]), freqs, heads=False)[0, 0]
        want = np.zeros(h)
        want[h - 64 + 2 * k] = math.cos(p * freqs[k])
        want[h - 64 + 2 * k + 1] = math.sin(p * freqs[k])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_inverse_undoes_forward(rng):
    cfg = release_cfg()
    freqs = rope_frequencies(cfg, "yarn")
    x = rng.standard_normal((2, 9, 4, 128)).astype(np.float32)
    pos = rng.integers(0, 100000, size=(2, 9))
    fwd = rope(x, pos, freqs, heads=True)
    back = rope(fwd, pos, freqs, heads=True, inverse=True)
    # the inverse reuses the same fp32 angles, so only the two rotations' roundings remain
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-5 * np.abs(x).max())
    # and the inverse alone is the conjugate rotation
    want = complex_rope_oracle(x, pos, freqs, heads=True, inverse=True)
    np.testing.assert_allclose(rope(x, pos, freqs, heads=True, inverse=True), want, rtol=0,
                               atol=angle_atol(x, pos, freqs))


def test_relative_position_property(rng):
    """q(p)·k(p') = Re Σ_k q_k conj(k_k) e^{i(p−p')f_k} + (unrotated part): a function of p − p' only."""
    cfg = release_cfg()
    freqs = rope_frequencies(cfg, "yarn")
    h, rd = 96, 64
    q = rng.standard_normal(h).astype(np.float32)
    k = rng.standard_normal(h).astype(np.float32)
    pairs = [(p, pp) for p in range(0, 48, 5) for pp in range(0, 48, 7)]
    pq = np.array([[p for p, _ in pairs]])
    pk = np.array([[pp for _, pp in pairs]])
    rq = rope(np.broadcast_to(q, (1, len(pairs), h)).copy(), pq, freqs, heads=False)[0]
    rk = rope(np.broadcast_to(k, (1, len(pairs), h)).copy(), pk, freqs, heads=False)[0]
    got = (rq.astype(np.float64) * rk).sum(-1)

    zq = q[h - rd::2] + 1j * q[h - rd + 1::2]
    zk = k[h - rd::2] + 1j * k[h - rd + 1::2]
    delta = (pq - pk)[0].astype(np.float64)
    want = (q[:h - rd].astype(np.float64) @ k[:h - rd]
            + (zq[None] * np.conj(zk[None]) * np.exp(1j * delta[:, None] * freqs.astype(np.float64))).real.sum(-1))
    scale = np.abs(q).astype(np.float64) @ np.abs(k)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale)
    # equal offsets give equal dot products
    by_delta = {}
    for d, v in zip(delta, got, strict=True):
        by_delta.setdefault(d, []).append(v)
    for vals in by_delta.values():
        assert np.ptp(vals) <= 2e-6 * scale
