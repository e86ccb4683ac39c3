"""Mosaic GPU kernels (``fp4_pack.mosaic``, ``block_max.mosaic``) == the XLA references, bit for bit.

Without a GPU (not marked): the threshold E2M1 encoding of ``fp4_pack.thresholds`` against
``dsv41_jax.quant`` exhaustively (every bf16 input x every scale), the kernels in the Mosaic GPU
interpreter (TMA tiling, the streaming loop, the numerics; register layouts are not modelled there), and
their lowering to Mosaic GPU for a cuda target (register layouts, TMA box shapes, SMEM plumbing; what is
left to the device is PTX compilation). Marked gpu: the compiled kernels on the device, each mismatch
reported with the variant, the case and the first differing group / block.

The references run on XLA:CPU (``on_cpu``): that is the semantics the kernels implement, including
XLA:CPU's flushing of subnormal inputs to zero.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv41_jax import quant
from pallas_kernels.block_max import mosaic as bm_mosaic
from pallas_kernels.block_max import reference as bm_reference
from pallas_kernels.fp4_pack import direct as fp4_direct
from pallas_kernels.fp4_pack import mosaic as fp4_mosaic
from pallas_kernels.fp4_pack import thresholds as th

REFERENCE = {"nvfp4": quant.pack_nvfp4, "mxfp4": quant.pack_mxfp4}
BLOCK = {"nvfp4": 16, "mxfp4": 32}


def on_cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return jax.tree.map(np.asarray, fn(*(jax.device_put(np.asarray(a), cpu) for a in args)))


# ------------------------------------------------------------------------------------------------
# The threshold encoding, exhaustively

_E4M3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
NVFP4_SCALES = np.unique(_E4M3[np.isfinite(_E4M3) & (_E4M3 >= 2.0**-9)])  # every scale amax >= 6 * 2^-9 gives
_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
ALL_BF16 = _BF16[np.isfinite(_BF16)]


def _sign_code(x):
    return (lax.bitcast_convert_type(x, jnp.int32) >> 28) & 8


@jax.jit
def _nvfp4_ref_codes(x, s):
    return quant._e2m1_codes(quant._round_e2m1(jnp.clip(quant._div_rn(x, s), -6.0, 6.0))).astype(jnp.int32)


@jax.jit
def _nvfp4_threshold_codes(x, s):
    return th.code_index(jnp.abs(x), th.nvfp4_thresholds(s)) | _sign_code(x)


@jax.jit
def _mxfp4_ref_codes(x, e):
    return quant._e2m1_codes(quant._round_e2m1(x * quant._pow2(jnp.maximum(-e, -126)))).astype(jnp.int32)


@jax.jit
def _mxfp4_threshold_codes(x, e):
    return th.code_index(jnp.abs(x), th.mxfp4_thresholds(e)) | _sign_code(x)


def _near_thresholds(scales_or_thresholds: np.ndarray, spread: int = 6) -> np.ndarray:
    """fp32 values within `spread` ulps of each threshold, both signs."""
    steps = np.arange(-spread, spread + 1, dtype=np.int32)
    bits = np.asarray(scales_or_thresholds, np.float32).view(np.int32)[:, None] + steps
    v = bits.reshape(-1).view(np.float32)
    return np.concatenate([v, -v])


def test_nvfp4_thresholds_exhaustive_bf16():
    """Every bf16 x every E4M3 scale: 7 compares == division, fp32 rounding, E2M1 rounding."""
    for chunk in np.array_split(NVFP4_SCALES, 4):
        x = np.tile(ALL_BF16, len(chunk))
        s = np.repeat(chunk, len(ALL_BF16))
        want, got = np.asarray(_nvfp4_ref_codes(x, s)), np.asarray(_nvfp4_threshold_codes(x, s))
        bad = np.nonzero(want != got)[0][:5]
        assert bad.size == 0, f"x={x[bad]} s={s[bad]} want={want[bad]} got={got[bad]}"


def test_nvfp4_thresholds_fp32_near_ties_and_random():
    mus = np.asarray(th.MIDPOINTS, np.float32)
    near = _near_thresholds((NVFP4_SCALES[:, None] * mus).reshape(-1))
    s_near = np.repeat(np.repeat(NVFP4_SCALES, len(mus)), 13)
    s_near = np.concatenate([s_near, s_near])
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(1 << 20) * 2.0 ** rng.integers(-30, 30, 1 << 20)).astype(np.float32)
    for x, s in ((near, s_near), (rand, rng.choice(NVFP4_SCALES, rand.size))):
        np.testing.assert_array_equal(_nvfp4_threshold_codes(x, s), _nvfp4_ref_codes(x, s))


def test_nvfp4_scale_matches_reference():
    amax = np.concatenate([ALL_BF16[ALL_BF16 > 0],
                           np.abs(np.random.default_rng(1).standard_normal(1 << 18)).astype(np.float32) * 500])
    s, byte = jax.jit(th.nvfp4_scale)(amax)
    want = on_cpu(lambda a: quant._round_e4m3(quant._div_rn(jnp.maximum(a, 6 * 2.0**-9), jnp.float32(6))), amax)
    np.testing.assert_array_equal(np.asarray(s), want)
    np.testing.assert_array_equal(np.asarray(byte).astype(np.uint8), want.astype(jnp.float8_e4m3fn).view(np.uint8))


def test_mxfp4_thresholds_exhaustive_bf16():
    """Every bf16 x every scale exponent: 7 compares == exact product, E2M1 rounding (subnormals as zero)."""
    exps = np.arange(-126, 127, dtype=np.int32)
    for chunk in np.array_split(exps, 4):
        x = np.tile(ALL_BF16, len(chunk))
        e = np.repeat(chunk, len(ALL_BF16))
        np.testing.assert_array_equal(_mxfp4_threshold_codes(x, e), _mxfp4_ref_codes(x, e))


def test_mxfp4_thresholds_fp32_near_ties():
    exps = np.arange(-126, 127, dtype=np.int32)
    mus = np.asarray(th.MIDPOINTS, np.float64)
    t = (mus[None, :] * 2.0 ** exps[:, None].astype(np.float64)).reshape(-1)
    keep = (t >= 2.0**-126) & (t < 3e38)
    x = _near_thresholds(t[keep].astype(np.float32))
    e = np.repeat(np.repeat(exps, len(mus))[keep], 13)
    np.testing.assert_array_equal(_mxfp4_threshold_codes(x, np.concatenate([e, e])),
                                  _mxfp4_ref_codes(x, np.concatenate([e, e])))


# ------------------------------------------------------------------------------------------------
# Kernel cases

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0])


def fp4_cases(fmt: str, n: int):
    """(name, [rows, n] fp32) cases: random, wide scale ranges, exact ties, saturation, zeros, tiny."""
    rng = np.random.default_rng(n + len(fmt))
    block = BLOCK[fmt]
    g = n // block
    yield "normal", rng.standard_normal((37, n)).astype(np.float32) * 3
    yield "scales", (rng.standard_normal((24, n)) * 2.0 ** rng.integers(-24, 24, (24, 1))).astype(np.float32)
    t = rng.choice(E2M1_TIES, size=(20, g, block)) * rng.choice([-1.0, 1.0], size=(20, g, block))
    if fmt == "nvfp4":  # amax = 6 s exactly, so x / s = t exactly
        s, top = rng.choice(NVFP4_SCALES[NVFP4_SCALES >= 2.0**-6], size=(20, g, 1)), 6.0
    else:  # amax = 4 s or 5 s: ceil(log2(amax / 6)) = log2 s
        s, top = 2.0 ** rng.integers(-30, 30, size=(20, g, 1)), rng.choice([4.0, 5.0], size=(20, g, 1))
    t[..., :1] = top * np.sign(rng.standard_normal((20, g, 1)))
    yield "ties", (t * s).reshape(20, n).astype(np.float32)
    sat = rng.standard_normal((7, n)).astype(np.float32)
    sat[0] *= 1e4  # nvfp4 scale saturates at 448
    sat[1] = np.sign(sat[1]) * 6.3  # amax / 6 = 1.05 rounds down to scale 1: |x / s| = 6.3 -> 6
    sat[2] = 0.0
    sat[3] = -0.0  # codes keep the sign bit (-0 -> 8)
    sat[4] *= 1e-5  # below the amax floors
    sat[5, ::3] = 0.0
    sat[6] *= 1e-36  # near the bottom of the normal range (mxfp4 scale 2^-126)
    yield "saturation_zero_tiny", sat


def all_fp4_cases(fmt: str, n: int) -> np.ndarray:
    return np.concatenate([x for _, x in fp4_cases(fmt, n)])


def fp4_diagnosis(x, got, want, fmt: str, label: str) -> str:
    """'' when equal; else which bytes differ, with the first differing group's inputs."""
    x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    block = BLOCK[fmt]
    gc, wc = (np.asarray(a).reshape(x.shape[0], -1) for a in (got[0], want[0]))
    gs, ws = (np.asarray(a).view(np.uint8).reshape(x.shape[0], -1) for a in (got[1], want[1]))
    if gc.shape != wc.shape or gs.shape != ws.shape:
        return f"{label}: shapes codes {gc.shape} vs {wc.shape}, scales {gs.shape} vs {ws.shape}"
    code_bad = (gc != wc).reshape(x.shape[0], -1, block // 2).any(-1)
    bad = code_bad | (gs != ws)
    if not bad.any():
        return ""
    r, g = map(int, np.argwhere(bad)[0])
    sl = slice(g * block // 2, (g + 1) * block // 2)
    return (f"{label}: {int(bad.sum())} of {bad.size} groups differ (codes {int(code_bad.sum())}, scales "
            f"{int((gs != ws).sum())}); rows with a difference: {np.unique(np.argwhere(bad)[:, 0])[:20].tolist()}; "
            f"first at row {r} group {g}: scale got {gs[r, g]} want {ws[r, g]}; codes got {gc[r, sl].tolist()} want "
            f"{wc[r, sl].tolist()}; input {x[r, g * block:(g + 1) * block].tolist()}")


def fp4_check(impl, x, fmt, label, dtype=jnp.float32):
    """impl(x as dtype, fmt) == the reference on x (x holds values that dtype represents)."""
    want = on_cpu(REFERENCE[fmt], x)
    got = jax.tree.map(np.asarray, impl(jnp.asarray(x, dtype), fmt))
    msg = fp4_diagnosis(np.asarray(x, np.float32), got, want, fmt, label)
    assert not msg, msg
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype, (got[1].dtype, want[1].dtype)


def bm_scores(rng, b: int, s: int, t: int, *, ties: bool, dtype=jnp.float32):
    """Causally masked scores (-inf at t >= n_p) with n_p over [0, T], including 0 and T."""
    x = rng.standard_normal((b, s, t))
    if ties:
        x = np.maximum(np.round(x * 2), 0.0)
    n = rng.integers(0, t + 1, (b, s))
    n.flat[0], n.flat[-1] = 0, t
    x = np.where(np.arange(t) < n[..., None], x, -np.inf)
    return jnp.asarray(x, dtype), jnp.asarray(n, jnp.int32)


def bm_diagnosis(scores, n, got, want, block_size: int, label: str) -> str:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        return f"{label}: shape {got.shape} vs {want.shape}"
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    if not bad.any():
        return ""
    b, s, k = map(int, np.argwhere(bad)[0])
    sc = np.asarray(scores, np.float32)[b, s, k * block_size:(k + 1) * block_size]
    return (f"{label}: {int(bad.sum())} of {bad.size} maxima differ; first at [{b}, {s}, block {k}] "
            f"(n_p={int(np.asarray(n)[b, s])}, newest block {(int(np.asarray(n)[b, s]) - 1) // block_size}): "
            f"got {got[b, s, k]} want {want[b, s, k]}; scores {sc.tolist()}")


def _bm_check(impl, scores, n, block_size, label):
    want = on_cpu(functools.partial(bm_reference.block_max, block_size=block_size), scores, n)
    got = np.asarray(impl(scores, n, block_size))
    msg = bm_diagnosis(scores, n, got, want, block_size, label)
    assert not msg, msg
    assert got.dtype == want.dtype


BM_SHAPES = [(1, 1, 8, 8), (2, 3, 37, 8), (3, 2, 129, 8), (2, 5, 100, 4), (1, 3, 70, 16), (2, 2, 5, 8),
             (2, 1, 3000, 8), (1, 2, 2048, 8)]  # several tiles of 1024 positions: ragged, whole

# ------------------------------------------------------------------------------------------------
# Interpreted kernels (CPU)


@pytest.mark.parametrize("fmt,n,rows_per_step", [("nvfp4", 512, 16), ("mxfp4", 128, 32), ("nvfp4", 128, 16),
                                                 ("mxfp4", 512, 8), ("nvfp4", 96, 64), ("mxfp4", 64, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp4_interpreted(fmt, n, rows_per_step, dtype):
    x = np.asarray(jnp.asarray(all_fp4_cases(fmt, n), dtype).astype(jnp.float32))  # values the dtype holds
    impl = functools.partial(fp4_mosaic.pack, rows_per_step=rows_per_step, interpret=True)
    fp4_check(impl, x, fmt, f"interpret {fmt} N={n} {jnp.dtype(dtype).name}", dtype)


@pytest.mark.parametrize("fmt,n,groups_per_cta", [("nvfp4", 512, 256), ("mxfp4", 128, 128), ("nvfp4", 96, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp4_direct_interpreted(fmt, n, groups_per_cta, dtype):
    """The SMEM-less pack (``direct``) on every case, with a tail of groups past its last CTA (N = 96: 6
    groups a row) that the reference fills in."""
    x = np.asarray(jnp.asarray(all_fp4_cases(fmt, n), dtype).astype(jnp.float32))
    impl = functools.partial(fp4_direct.pack, groups_per_cta=groups_per_cta, interpret=True)
    fp4_check(impl, x, fmt, f"direct {fmt} N={n} {jnp.dtype(dtype).name}", dtype)
    fp4_check(impl, x[:3], fmt, f"direct {fmt} N={n}, 3 rows (all tail)", dtype)
    with pytest.raises(ValueError, match="groups_per_cta"):
        fp4_direct.pack(jnp.zeros((8, n)), fmt, groups_per_cta=100)


@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 96)])
def test_fp4_interpreted_swar_encode(fmt, n):
    """The two-lanes-per-word encode on every case (rounding ties, saturation, zero groups, subnormals) in bf16,
    the only input it takes."""
    x = np.asarray(jnp.asarray(all_fp4_cases(fmt, n), jnp.bfloat16).astype(jnp.float32))
    impl = functools.partial(fp4_mosaic.pack, encode="swar", interpret=True)
    fp4_check(impl, x, fmt, f"interpret swar {fmt} N={n}", jnp.bfloat16)
    with pytest.raises(ValueError, match="needs bf16 input"):
        fp4_mosaic.pack(jnp.zeros((8, n), jnp.float32), fmt, encode="swar")


@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 96)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp4_interpreted_bsearch_encode(fmt, n, dtype):
    """The binary-search code index on every case, both input dtypes."""
    x = np.asarray(jnp.asarray(all_fp4_cases(fmt, n), dtype).astype(jnp.float32))
    impl = functools.partial(fp4_mosaic.pack, encode="bsearch", interpret=True)
    fp4_check(impl, x, fmt, f"interpret bsearch {fmt} N={n} {jnp.dtype(dtype).name}", dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_interpreted_leading_dims_and_empty(fmt):
    rng = np.random.default_rng(1)
    impl = functools.partial(fp4_mosaic.pack, rows_per_step=32, interpret=True)
    for shape in ((0, 128), (2, 0, 128), (3, 128), (2, 3, 11, 128)):
        x = rng.standard_normal(shape).astype(np.float32)
        want = on_cpu(REFERENCE[fmt], x)
        got = impl(jnp.asarray(x), fmt)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8), want[1].view(np.uint8))


@pytest.mark.parametrize("ties", [False, True])
def test_block_max_interpreted(ties):
    rng = np.random.default_rng(int(ties))
    impl = functools.partial(bm_mosaic.block_max, positions_per_step=1024, chunk_blocks=128, interpret=True)
    for b, s, t, bs in BM_SHAPES:
        for dtype in (jnp.float32, jnp.bfloat16) if ties else (jnp.float32,):
            scores, n = bm_scores(rng, b, s, t, ties=ties, dtype=dtype)
            _bm_check(impl, scores, n, bs, f"interpret {(b, s, t)} block {bs} {jnp.dtype(dtype).name}")


def test_block_max_interpreted_unmasked_scores():
    """Scores past n_p that were not masked still count (only positions past T are padding)."""
    scores = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 45)), jnp.float32)
    n = jnp.asarray([[0, 1, 45], [8, 9, 17]], jnp.int32)
    impl = functools.partial(bm_mosaic.block_max, positions_per_step=1024, chunk_blocks=128, interpret=True)
    _bm_check(impl, scores, n, 8, "interpret unmasked")


# ------------------------------------------------------------------------------------------------
# Lowering to Mosaic GPU for a cuda target (CPU): layouts, TMA boxes, SMEM plumbing


def _lowers(fn, *avals) -> str:
    text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


FP4_VARIANTS = [dict(), dict(layout_name="wgmma", chunk=64), dict(rows_per_step=16, chunk=256, stages=2),
                dict(no_auto_barriers=False, ctas_per_sm=2, stages=3, step_bytes=24576)]


def _fp4_variant(i: int, fmt: str, n: int) -> dict:
    kw = dict(FP4_VARIANTS[i])
    if "rows_per_step" in kw:  # rounded up to whole multiples of 128 groups per tile
        unit = 128 // math.gcd(128, n // BLOCK[fmt])
        kw["rows_per_step"] = -(-kw["rows_per_step"] // unit) * unit
    return kw


@pytest.mark.parametrize("variant", range(len(FP4_VARIANTS)))
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 1024), ("mxfp4", 512), ("nvfp4", 96),
                                   ("mxfp4", 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp4_lowers_to_mosaic_gpu(variant, fmt, n, dtype):
    kw = _fp4_variant(variant, fmt, n)
    _lowers(functools.partial(fp4_mosaic.pack, fmt=fmt, **kw), jax.ShapeDtypeStruct((300, n), dtype))


@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 1024)])
@pytest.mark.parametrize("encode", ["swar", "bsearch"])
def test_other_encodes_lower_to_mosaic_gpu(fmt, n, encode):
    _lowers(functools.partial(fp4_mosaic.pack, fmt=fmt, encode=encode), jax.ShapeDtypeStruct((300, n), jnp.bfloat16))


@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 1024), ("mxfp4", 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_unpack_lowers_to_mosaic_gpu(fmt, n, dtype):
    g = n // BLOCK[fmt]
    scale_dtype = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
    _lowers(functools.partial(fp4_mosaic.unpack, fmt=fmt, dtype=dtype), jax.ShapeDtypeStruct((300, n // 2), jnp.uint8),
            jax.ShapeDtypeStruct((300, g), scale_dtype))


BM_VARIANTS = [dict(), dict(layout_name="wgmma", chunk_blocks=256), dict(positions_per_step=16384, stages=2),
               dict(no_auto_barriers=True, ctas_per_sm=3, chunk_blocks=128)]


@pytest.mark.parametrize("variant", range(len(BM_VARIANTS)))
@pytest.mark.parametrize("shape,block_size", [((8, 1, 1 << 20), 8), ((2, 64, 2053), 8), ((3, 2, 100), 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_max_lowers_to_mosaic_gpu(variant, shape, block_size, dtype):
    _lowers(functools.partial(bm_mosaic.block_max, block_size=block_size, **BM_VARIANTS[variant]),
            jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape[:2], jnp.int32))


def test_bad_tilings_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp4_mosaic.pack(jnp.zeros((8, 128)), "mxfp4", rows_per_step=8)  # 32 groups per tile
    with pytest.raises(ValueError, match="chunk"):
        fp4_mosaic.pack(jnp.zeros((8, 512)), "nvfp4", chunk=96)
    with pytest.raises(ValueError, match="N/2"):
        fp4_mosaic.pack(jnp.zeros((8, 16)), "nvfp4")  # 8 code bytes per row: below a TMA row
    with pytest.raises(ValueError, match="block_size"):
        bm_mosaic.block_max(jnp.zeros((1, 1, 64)), jnp.ones((1, 1), jnp.int32), 6)
    with pytest.raises(ValueError, match="groups per tile"):
        fp4_mosaic.unpack(jnp.zeros((8, 64), jnp.uint8), jnp.zeros((8, 8), jnp.uint8), "nvfp4", rows_per_step=8)
    with pytest.raises(ValueError, match="SMEM"):  # 4096 groups x 64 bytes of fp32 output, double-buffered
        fp4_mosaic.unpack(jnp.zeros((8, 256), jnp.uint8), jnp.zeros((8, 32), jnp.uint8), "nvfp4", rows_per_step=128)


# ------------------------------------------------------------------------------------------------
# On the device


def _gpu_fp4_params():
    """Every variant on the release shapes; the default variant also on wider rows."""
    for v in range(len(FP4_VARIANTS)):
        for fmt, n in (("nvfp4", 512), ("mxfp4", 128)) + ((("nvfp4", 1024), ("mxfp4", 512)) if v == 0 else ()):
            yield v, fmt, n


def _named_rows(fmt: str, n: int):
    """All cases stacked (one compile per variant and dtype) and the case name of each row."""
    cases = list(fp4_cases(fmt, n))
    return np.concatenate([x for _, x in cases]), np.concatenate([[name] * len(x) for name, x in cases])


@pytest.mark.gpu
@pytest.mark.parametrize("variant,fmt,n", list(_gpu_fp4_params()))
def test_fp4_on_device(variant, fmt, n):
    kw = _fp4_variant(variant, fmt, n)
    impl = functools.partial(fp4_mosaic.pack, **kw)
    x_all, names = _named_rows(fmt, n)
    big = np.random.default_rng(3).standard_normal((4099, n)).astype(np.float32)
    errors = []
    for dtype in (jnp.bfloat16, jnp.float32):
        cast = lambda v, dt=dtype: np.asarray(jnp.asarray(v, dt).astype(jnp.float32))  # noqa: E731
        for x, label in ((cast(x_all), "cases"), (cast(big), "4099 rows"), (cast(big[:3]), "3 rows")):
            try:
                fp4_check(impl, x, fmt, f"{kw} {fmt} N={n} {jnp.dtype(dtype).name} {label}", dtype)
            except AssertionError as e:
                msg = str(e)
                if label == "cases":
                    rows = [int(r) for r in np.unique(np.argwhere(
                        np.asarray(impl(jnp.asarray(x, dtype), fmt)[0]) != on_cpu(REFERENCE[fmt], x)[0])[:, 0])]
                    msg += f"; cases with a difference: {sorted(set(names[rows].tolist()))}"
                print("MISMATCH", msg, flush=True)  # shown at once with pytest -s, even if the run is cut short
                errors.append(msg)
    assert not errors, "\n".join(errors)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 96)])
def test_fp4_direct_on_device(fmt, n):
    """The SMEM-less pack on the GPU: every case, 4099 rows (a tail past the last CTA) and 3, both dtypes."""
    x_all, _ = _named_rows(fmt, n)
    big = np.random.default_rng(3).standard_normal((4099, n)).astype(np.float32)
    for dtype in (jnp.bfloat16, jnp.float32):
        for x, label in ((x_all, "cases"), (big, "4099 rows"), (big[:3], "3 rows")):
            x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
            for gpc in (128, 512):
                impl = functools.partial(fp4_direct.pack, groups_per_cta=gpc)
                fp4_check(impl, x, fmt, f"direct {gpc} {fmt} N={n} {jnp.dtype(dtype).name} {label}", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128)])
@pytest.mark.parametrize("encode", ["swar", "bsearch"])
def test_fp4_other_encodes_on_device(fmt, n, encode):
    impl = functools.partial(fp4_mosaic.pack, encode=encode)
    x_all, _ = _named_rows(fmt, n)
    big = np.random.default_rng(3).standard_normal((4099, n)).astype(np.float32)
    for x, label in ((x_all, "cases"), (big, "4099 rows"), (big[:3], "3 rows")):
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        fp4_check(impl, x, fmt, f"{encode} {fmt} N={n} {label}", jnp.bfloat16)


@pytest.mark.gpu
def test_fp4_on_device_leading_dims():
    x = np.random.default_rng(4).standard_normal((2, 3, 11, 512)).astype(np.float32)
    for dtype in (jnp.bfloat16, jnp.float32):
        xd = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
        for fmt in ("nvfp4", "mxfp4"):
            fp4_check(fp4_mosaic.pack, xd, fmt, f"leading dims {fmt} {jnp.dtype(dtype).name}", dtype)


BM_DEVICE_SHAPES = BM_SHAPES + [(8, 1, 1 << 20, 8), (128, 1, 4099, 8), (2, 64, 2053, 8), (32, 1, 1 << 17, 8)]
BM_DEVICE_SHAPES_OTHER_VARIANTS = [(2, 3, 37, 8), (1, 3, 70, 16), (8, 1, 1 << 20, 8), (2, 64, 2053, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", range(len(BM_VARIANTS)))
def test_block_max_on_device(variant):
    kw = BM_VARIANTS[variant]
    impl = functools.partial(bm_mosaic.block_max, **kw)
    errors = []
    for ties in (False, True):
        rng = np.random.default_rng(7 + int(ties))
        for b, s, t, bs in BM_DEVICE_SHAPES if variant == 0 else BM_DEVICE_SHAPES_OTHER_VARIANTS:
            if kw.get("layout_name") == "wgmma" and bs % 8:
                continue
            for dtype in (jnp.float32, jnp.bfloat16) if ties else (jnp.float32,):
                scores, n = bm_scores(rng, b, s, t, ties=ties, dtype=dtype)
                try:
                    _bm_check(impl, scores, n, bs, f"{kw} {(b, s, t)} block {bs} ties={ties} {jnp.dtype(dtype).name}")
                except AssertionError as e:
                    print("MISMATCH", e, flush=True)
                    errors.append(str(e))
    assert not errors, "\n".join(errors)


@pytest.mark.gpu
def test_block_max_on_device_candidate_ids():
    """block maxima + XLA top_k (as api.candidate_block_ids) == indexer.candidate_block_ids."""
    from dsv41_jax.model import indexer

    for b, s, t in ((8, 1, 1 << 20), (2, 64, 2053)):
        scores, n = bm_scores(np.random.default_rng(t), b, s, t, ties=True)
        bmax = bm_mosaic.block_max(scores, n, 8)
        nb = bmax.shape[-1]
        vals, idx = lax.top_k(bmax, min(2048, nb))
        ids = jnp.sort(jnp.where(vals > -jnp.inf, idx, nb), axis=-1)
        ids = jnp.where(ids < nb, ids, -1).astype(jnp.int32)
        want = on_cpu(functools.partial(indexer.candidate_block_ids, block_size=8, n_blocks=2048), scores, n)
        np.testing.assert_array_equal(np.asarray(ids), want)
