"""The bf16x2 encode (``fp4_pack.pairs``): its thresholds and arithmetic against ``dsv41_jax.quant``
exhaustively (every bf16 input x every scale), the SMEM-less pack with it in the Mosaic GPU interpreter,
its lowering for a cuda target, and (marked gpu) its PTX on the device.

The exhaustive tests run :func:`pairs.codes_model`, the jnp form of the PTX; the device test is what
ties the PTX to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv41_jax import quant
from pallas_kernels.fp4_pack import direct, pairs
from tests.kernels.test_mosaic_gpu import ALL_BF16, NVFP4_SCALES, all_fp4_cases, fp4_check, on_cpu

# every finite bf16 as a word: the value in the low lane, its negation in the high lane
_BITS = np.asarray(ALL_BF16, np.float32).view(np.uint32) >> 16
WORDS = (_BITS | ((_BITS ^ 0x8000) << 16)).astype(np.uint32).view(np.int32)


def _ref_codes(fmt: str, x, scale):
    """fp32 values and per-value scales (nvfp4: the E4M3 value; mxfp4: the exponent) -> E2M1 codes."""
    if fmt == "nvfp4":
        q = jnp.clip(quant._div_rn(x, scale), -6.0, 6.0)
    else:
        q = x * quant._pow2(jnp.maximum(-scale, -126))
    return quant._e2m1_codes(quant._round_e2m1(q)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="fmt")
def _both(fmt: str, words, scale):
    """Words [M] and scales [M] -> (codes_model's byte, the reference's byte) as int32 [M]."""
    pats = pairs.nvfp4_patterns(scale) if fmt == "nvfp4" else pairs.mxfp4_patterns(scale)
    got = pairs.codes_model(words[:, None], [pairs.pair(p)[:, None] for p in pats])[:, 0].astype(jnp.int32)
    lo = lax.bitcast_convert_type(words << 16, jnp.float32)
    hi = lax.bitcast_convert_type(words & -65536, jnp.float32)
    return got, _ref_codes(fmt, lo, scale) | (_ref_codes(fmt, hi, scale) << 4)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_codes_exhaustive(fmt):
    """Every finite bf16 (both signs) x every scale: the bf16 thresholds and the count == the reference."""
    scales = NVFP4_SCALES if fmt == "nvfp4" else np.arange(-126, 127, dtype=np.int32)
    for chunk in np.array_split(scales, 8):
        w = np.tile(WORDS, len(chunk))
        s = np.repeat(chunk, len(WORDS))
        got, want = (np.asarray(a) for a in on_cpu(functools.partial(_both, fmt), w, s))
        bad = np.nonzero(got != want)[0][:5]
        assert bad.size == 0, f"{fmt}: words {w[bad]} scales {s[bad]} got {got[bad]} want {want[bad]}"


def test_patterns_are_bf16_values():
    """Each tie-up threshold is mu s itself (exact in bf16), each tie-down one bf16 step above it."""
    s = jnp.asarray(NVFP4_SCALES)
    for p, mu, up in zip(pairs.nvfp4_patterns(s), pairs.thresholds.MIDPOINTS, pairs.thresholds.TIE_UP,
                         strict=True):
        exact = np.asarray(NVFP4_SCALES * np.float32(mu), np.float32)
        assert (exact.view(np.uint32) & 0xFFFF == 0).all()  # exact in bf16
        np.testing.assert_array_equal(np.asarray(p), (exact.view(np.uint32) >> 16) + (0 if up else 1))


def test_nvfp4_scale_from_quotient_exhaustive():
    """Every bf16 amax (and fp32 ones around each E4M3 midpoint and the subnormal/normal boundary): the
    bit rounding of max(amax, 6 2^-9) / 6 == the reference's scale and byte."""
    mids = np.unique(np.asarray(NVFP4_SCALES, np.float64)[:, None] * np.array([1.0, 1.0625, 1.03125]))
    near = (np.asarray(mids * 6, np.float32).view(np.int32)[:, None] + np.arange(-3, 4)).reshape(-1).view(np.float32)
    amax = np.concatenate([ALL_BF16[ALL_BF16 >= 0], near[near > 0]]).astype(np.float32)

    def ours(a):
        return pairs.nvfp4_scale_from_quotient(quant._div_rn(jnp.maximum(a, 6 * 2.0**-9), jnp.float32(6.0)))

    s, byte = on_cpu(ours, amax)
    want = on_cpu(lambda a: quant._round_e4m3(quant._div_rn(jnp.maximum(a, 6 * 2.0**-9), jnp.float32(6))), amax)
    np.testing.assert_array_equal(s, want)
    np.testing.assert_array_equal(byte.astype(np.uint8), want.astype(jnp.float8_e4m3fn).view(np.uint8))


def test_row_amax_model():
    rows = np.random.default_rng(0).choice(WORDS, (4096, 8))
    got = np.asarray(pairs.row_amax_model(jnp.asarray(rows)))
    lanes = np.asarray(lax.bitcast_convert_type(jnp.asarray(rows), jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, np.abs(lanes).reshape(4096, -1).max(-1))


@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 96)])
def test_direct_pairs_interpreted(fmt, n):
    """The SMEM-less pack with ``encode="pairs"`` (the bf16 default) on every case, in the interpreter."""
    x = np.asarray(jnp.asarray(all_fp4_cases(fmt, n), jnp.bfloat16).astype(jnp.float32))
    impl = functools.partial(direct.pack, encode="pairs", groups_per_cta=128, interpret=True)
    fp4_check(impl, x, fmt, f"pairs {fmt} N={n}", jnp.bfloat16)


def test_pairs_needs_bf16():
    with pytest.raises(ValueError, match="encode='pairs' needs bf16 input"):
        direct.pack(jnp.zeros((128, 512), jnp.float32), "nvfp4", encode="pairs", interpret=True)


@pytest.mark.parametrize("fmt,n,kw", [("nvfp4", 512, {}), ("mxfp4", 128, {}), ("nvfp4", 512, {"groups_per_cta": 128})])
def test_direct_pairs_lowers(fmt, n, kw):
    """The inline PTX lowers into the Mosaic GPU module for a cuda target (PTX assembly is left to the
    device)."""
    fn = functools.partial(direct.pack, fmt=fmt, encode="pairs", **kw)
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((4096, n), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 96)])
def test_direct_pairs_on_device(fmt, n):
    """The PTX on the device == the reference: every case; every finite bf16 of both signs (in order, so
    each group spans a narrow range of magnitudes); every bf16 as a group's amax (one a group, with
    random smaller lanes); a tail past the last CTA; 3 rows."""
    impl = functools.partial(direct.pack, encode="pairs")
    lanes = np.asarray(lax.bitcast_convert_type(jnp.asarray(WORDS), jnp.bfloat16).astype(jnp.float32)).reshape(-1)
    rng = np.random.default_rng(7)
    block = {"nvfp4": 16, "mxfp4": 32}[fmt]
    amax = np.abs(lanes)[: lanes.size // (n // block) * (n // block)]
    groups = amax[:, None] * rng.uniform(-1, 1, (amax.size, block)).astype(np.float32)
    groups[np.arange(amax.size), rng.integers(0, block, amax.size)] = amax * rng.choice([-1, 1], amax.size)
    big = rng.standard_normal((4099, n)).astype(np.float32)
    for x, label in ((all_fp4_cases(fmt, n), "cases"), (lanes[: lanes.size // n * n].reshape(-1, n), "all bf16"),
                     (groups.reshape(-1, n), "every amax"), (big, "4099 rows"), (big[:3], "3 rows")):
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        for gpc in (128, None):  # None: the default, 1024 for nvfp4
            fp4_check(functools.partial(impl, groups_per_cta=gpc), x, fmt, f"pairs {gpc} {fmt} N={n} {label}",
                       jnp.bfloat16)
