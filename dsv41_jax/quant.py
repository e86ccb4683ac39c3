"""Numerics of DeepSeek-V4.1-Flash's quantised formats (spec attention §7, model §2.2-2.3).

Three activation / KV-cache formats, each over contiguous groups of the last axis:

=================  ==========================  =====  ====================================  ============
name               element + scale             group  used for                              bytes/vector
=================  ==========================  =====  ====================================  ============
``fp8_ue8m0``      E4M3 + power-of-two E8M0    32     SWA KV (512 lanes), FP8-linear inputs  528 B / 512
``nvfp4``          E2M1 + E4M3 (no global)     16     main (compressed) KV (512 lanes)      288 B / 512
``mxfp4``          E2M1 + power-of-two E8M0    32     indexer q and k (128 lanes)            68 B / 128
=================  ==========================  =====  ====================================  ============

``qdq_*`` is the fake quantisation the model was trained with: fp32 math, result in the input dtype,
straight-through gradient (spec attention §7.6). ``pack_*`` / ``unpack_*`` give the storage form
(low nibble = even element, E2M1 code bit 3 = sign), and ``unpack(pack(x)) == qdq(x)`` bit for bit.
Rounding is arithmetic (exponent bits + ``round`` half-to-even), never a float cast round trip:
XLA:GPU deletes ``f32 -> fp8 -> f32`` inside one jit (notes/PLATFORM.md). Divisions are exact
products by powers of two, or (nvfp4's E4M3 scale) integer long division: XLA:GPU's f32 divide is
``div.full``, up to 2 ulp off, which breaks E2M1 ties.

The weight helpers decode the released checkpoint formats (spec model §2.2): FP8 E4M3 with 32x32 E8M0
block scales, MXFP4 routed experts with per-row per-32 E8M0 scales, and FP8 Engram tables with per-row
per-32 scales. They accept numpy or jax inputs, and E8M0 scales as uint8 bytes or float8_e8m0fnu.
XLA:CPU flushes fp32 subnormals to zero, so inputs below 2^-126 count as zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Shaped, UInt8

# shape letters beyond the glossary: G scale groups along the last axis, P packed bytes (two E2M1 codes each),
# R x C scale tiles of a block-scaled matrix, E stacked experts
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude table, index = code bits 0-2
FP8_BLOCK, NVFP4_BLOCK, MXFP4_BLOCK = 32, 16, 32

# --------------------------------------------------------------------------------------------------
# Rounding primitives (fp32 in, fp32 out).


def _biased_exp(a: Array) -> Array:
    return (lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF


def _pow2(e: Array) -> Array:
    """2^e as fp32 for integer e in [-126, 127], built from the exponent bits (exact)."""
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def _ceil_log2(t: Array) -> Array:
    # spec attention §7.1 / model §2.3: exponent of the fp32 value, +1 if its mantissa is non-zero
    bits = lax.bitcast_convert_type(t, jnp.int32)
    return _biased_exp(t) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def _round_e4m3(v: Array) -> Array:
    """Round-to-nearest-even onto float8_e4m3fn, saturating at ±448 (cvt.rn.satfinite)."""
    # 3 mantissa bits: quantum 2^(e-3); binades below 2^-6 share the subnormal quantum 2^-9
    e = jnp.maximum(_biased_exp(jnp.abs(v)) - 127, -6)
    q = jnp.round(v * _pow2(3 - e)) * _pow2(e - 3)  # power-of-two scalings are exact
    return jnp.clip(q, -E4M3_MAX, E4M3_MAX)


def _round_e2m1(v: Array) -> Array:
    """Round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at ±6 (spec attention §7.2).

    Half-to-even on v/quantum picks the even code: the code index is 2v below 2, v+2 in [2, 4) and
    v/2+4 from 4, so its parity equals that of the rounded integer (.25->0, 1.25->1, 2.5->2, 5->4).
    """
    a = jnp.abs(v)
    e = jnp.where(a < 2, -1, jnp.where(a < 4, 0, 1))  # quantum 2^e
    return jnp.clip(jnp.round(v * _pow2(-e)) * _pow2(e), -E2M1_MAX, E2M1_MAX)


def _div_rn(x: Array, d: Array) -> Array:
    """x / d rounded to nearest even, for normal fp32 d with at most 4 significant bits (E4M3 values, 6).

    XLA:GPU lowers f32 division to div.full (up to 2 ulp off), which moves exact E2M1 ties such as
    1.171875 / 0.9375 = 1.25; the reference divides with round-to-nearest (spec attention §13.1).
    So the quotient is formed by integer long division of the significands.
    """
    xb, db = lax.bitcast_convert_type(x, jnp.int32), lax.bitcast_convert_type(d, jnp.int32)
    ex, ed = (xb >> 23) & 0xFF, (db >> 23) & 0xFF
    n = ((xb & 0x7FFFFF) | 0x800000) << 6  # x significand, 30 bits
    dd = ((db >> 20) & 7) | 8  # d significand as an integer in [8, 15]
    q, r = lax.div(n, dd), lax.rem(n, dd)  # 26-27 bit quotient
    shift = 8 - lax.clz(q)  # bits below the 24 kept ones
    kept, low, half = q >> shift, q & ((1 << shift) - 1), 1 << (shift - 1)
    up = (low > half) | ((low == half) & ((r != 0) | ((kept & 1) == 1)))
    mag = (kept + up).astype(jnp.float32) * _pow2(jnp.clip(ex - ed - 26 + shift, -126, 127))
    mag = jnp.where(ex == 0, 0.0, mag)  # zero (and subnormal x, flushed as XLA does)
    return jnp.where(ex == 0xFF, x, jnp.copysign(mag, x))


# --------------------------------------------------------------------------------------------------
# Format cores: grouped fp32 input [..., X/block, block] -> (element values, scale [..., X/block, 1]).


def _grouped(x: ArrayLike, block: int) -> Array:
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"quantisation needs the last axis ({n}) to be a multiple of the block ({block})")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)


def _amax(g: Array, floor: float) -> Array:
    return jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True), jnp.float32(floor))


def _fp8_ue8m0_core(g: Array) -> tuple[Array, Array]:
    # spec attention §7.1: amax >= 1e-4, s = 2^ceil(log2(amax * fp32(1/448))), q = e4m3(x / s)
    e = _ceil_log2(_amax(g, 1e-4) * jnp.float32(1 / E4M3_MAX))
    return _round_e4m3(g * _pow2(-e)), _pow2(e)  # x / 2^e as an exact product (no GPU div.full)


def _nvfp4_core(g: Array) -> tuple[Array, Array]:
    # spec attention §7.2: amax >= 6*2^-9, s = e4m3(amax / 6) rounded to nearest, v clipped to ±6
    s = _round_e4m3(_div_rn(_amax(g, E2M1_MAX * 2.0**-9), jnp.float32(E2M1_MAX)))
    return _round_e2m1(jnp.clip(_div_rn(g, s), -E2M1_MAX, E2M1_MAX)), s


def _mxfp4_core(g: Array) -> tuple[Array, Array]:
    # spec attention §7.3: amax >= 6*2^-126, s = 2^ceil(log2(amax * fp32(1/6))); x / s as exact x * 2^-e
    e = _ceil_log2(_amax(g, E2M1_MAX * 2.0**-126) * jnp.float32(1 / E2M1_MAX))
    return _round_e2m1(g * _pow2(jnp.maximum(-e, -126))), _pow2(e)


def _make_qdq(core):
    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def qdq(x, block):
        q, s = core(_grouped(x, block))
        return (q * s).reshape(x.shape).astype(x.dtype)

    def fwd(x, block):
        return qdq(x, block), None

    def bwd(block, _, g):
        return (g,)  # straight-through estimator, spec attention §7.6

    qdq.defvjp(fwd, bwd)
    return qdq


_qdq_fp8, _qdq_nvfp4, _qdq_mxfp4 = map(_make_qdq, (_fp8_ue8m0_core, _nvfp4_core, _mxfp4_core))


@functools.partial(jax.jit, static_argnames=("block",))
def qdq_fp8_ue8m0(x: Float[ArrayLike, "*B X"], block: int = FP8_BLOCK) -> Float[Array, "*B X"]:
    """FP8 E4M3 with a power-of-two scale per ``block`` (SWA KV; FP8-linear activations)."""
    return _qdq_fp8(jnp.asarray(x), block)


@functools.partial(jax.jit, static_argnames=("block",))
def qdq_nvfp4(x: Float[ArrayLike, "*B X"], block: int = NVFP4_BLOCK) -> Float[Array, "*B X"]:
    """E2M1 with an E4M3 scale per ``block`` and no global scale (main KV)."""
    return _qdq_nvfp4(jnp.asarray(x), block)


@functools.partial(jax.jit, static_argnames=("block",))
def qdq_mxfp4(x: Float[ArrayLike, "*B X"], block: int = MXFP4_BLOCK) -> Float[Array, "*B X"]:
    """E2M1 with a power-of-two scale per ``block`` (indexer q and k)."""
    return _qdq_mxfp4(jnp.asarray(x), block)


# --------------------------------------------------------------------------------------------------
# Storage: E2M1 nibbles, E4M3 bytes, E8M0 bytes (spec attention §7.4, model §2.2).


def _as_u8(x: ArrayLike) -> Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        return x
    if x.dtype.itemsize != 1:
        raise TypeError(f"expected 1-byte codes or E8M0 scales (uint8/int8/float8_e8m0fnu), got {x.dtype}")
    return lax.bitcast_convert_type(x, jnp.uint8)


def _e8m0_byte(s: Array) -> Array:
    return _biased_exp(s).astype(jnp.uint8)  # s is a normal power of two: the byte is its exponent field


def _e8m0_value(b: ArrayLike) -> Array:
    """E8M0 byte -> fp32 2^(b-127); b = 255 is NaN, b = 0 is the fp32 subnormal 2^-127."""
    b = _as_u8(b).astype(jnp.int32)
    bits = jnp.where(b == 0, 1 << 22, jnp.where(b == 255, 0x7FC00000, b << 23))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _e2m1_codes(c: Array) -> Array:
    """E2M1 grid values (fp32) -> 4-bit codes, integer arithmetic only; -0 keeps its sign bit."""
    m2 = (jnp.abs(c) * 2).astype(jnp.int32)  # 0, 1, 2, 3, 4, 6, 8, 12
    idx = jnp.where(m2 <= 4, m2, jnp.where(m2 <= 8, m2 // 2 + 2, 7))
    return (idx | (jnp.signbit(c).astype(jnp.int32) << 3)).astype(jnp.uint8)


def _e2m1_values(codes: Array) -> Array:
    mag = jnp.asarray(E2M1_GRID, jnp.float32)[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -mag, mag)


def _pack_nibbles(codes: Array) -> Array:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2i in the low nibble


def _unpack_nibbles(packed: ArrayLike) -> Array:
    p = _as_u8(packed)
    return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def _apply_scale(values: Array, scale: Array, dtype) -> Array:
    """values [..., X] * scale [..., X/block] broadcast over the blocks of X."""
    groups = values.reshape(*scale.shape, values.shape[-1] // scale.shape[-1])
    return (groups * scale[..., None]).reshape(values.shape).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def pack_nvfp4(
    x: Float[Array, "*B X"], block: int = NVFP4_BLOCK
) -> tuple[UInt8[Array, "*B X//2"], Shaped[Array, "*B G"]]:
    """x -> (E2M1 nibbles uint8, E4M3 scales float8_e4m3fn); 288 B per 512 lanes."""
    x = jnp.asarray(x)
    c, s = _nvfp4_core(_grouped(x, block))
    codes = _pack_nibbles(_e2m1_codes(c).reshape(x.shape))
    return codes, s[..., 0].astype(jnp.float8_e4m3fn)  # s is already on the E4M3 grid: exact cast


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_nvfp4(
    codes: UInt8[Array, "*B P"], scales: Shaped[Array, "*B G"], dtype=jnp.float32
) -> Float[Array, "*B X"]:
    return _apply_scale(_e2m1_values(_unpack_nibbles(codes)), jnp.asarray(scales).astype(jnp.float32), dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def pack_mxfp4(
    x: Float[Array, "*B X"], block: int = MXFP4_BLOCK
) -> tuple[UInt8[Array, "*B X//2"], UInt8[Array, "*B G"]]:
    """x -> (E2M1 nibbles uint8, E8M0 exponent bytes uint8); 68 B per 128 lanes."""
    x = jnp.asarray(x)
    c, s = _mxfp4_core(_grouped(x, block))
    return _pack_nibbles(_e2m1_codes(c).reshape(x.shape)), _e8m0_byte(s[..., 0])


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_mxfp4(
    codes: UInt8[Array, "*B P"], exps: UInt8[Array, "*B G"], dtype=jnp.float32
) -> Float[Array, "*B X"]:
    return _apply_scale(_e2m1_values(_unpack_nibbles(codes)), _e8m0_value(exps), dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def pack_fp8_ue8m0(
    x: Float[Array, "*B X"], block: int = FP8_BLOCK
) -> tuple[Shaped[Array, "*B X"], UInt8[Array, "*B G"]]:
    """x -> (E4M3 values float8_e4m3fn, E8M0 exponent bytes uint8); 528 B per 512 lanes."""
    x = jnp.asarray(x)
    q, s = _fp8_ue8m0_core(_grouped(x, block))
    return q.reshape(x.shape).astype(jnp.float8_e4m3fn), _e8m0_byte(s[..., 0])


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_fp8_ue8m0(
    values: Shaped[Array, "*B X"], exps: UInt8[Array, "*B G"], dtype=jnp.float32
) -> Float[Array, "*B X"]:
    return _apply_scale(jnp.asarray(values).astype(jnp.float32), _e8m0_value(exps), dtype)


# --------------------------------------------------------------------------------------------------
# Checkpoint weights (spec model §2.2). The E8M0 scale is a multiplier: W = stored * 2^(b - 127).


def _check_scale(name: str, scale_shape, want) -> None:
    if tuple(scale_shape) != tuple(want):
        raise ValueError(f"{name}: scale shape {tuple(scale_shape)} does not fit the weight; expected {want}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_fp8_blocks(
    w: Shaped[ArrayLike, "Y X"], scale_e8m0: Shaped[ArrayLike, "R C"], block: tuple[int, int] = (32, 32)
) -> Float[Array, "Y X"]:
    """Dense FP8 weight with one E8M0 scale per block[0] x block[1] tile (ragged edge tiles allowed)."""
    w = jnp.asarray(w)
    (o, i), (bo, bi) = w.shape, block
    _check_scale("dequant_fp8_blocks", np.shape(scale_e8m0), (_cdiv(o, bo), _cdiv(i, bi)))
    s = jnp.repeat(jnp.repeat(_e8m0_value(scale_e8m0), bo, axis=0), bi, axis=1)[:o, :i]
    return w.astype(jnp.float32) * s


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_fp4_rows(
    packed: Shaped[ArrayLike, "*E Y P"], scale_e8m0: Shaped[ArrayLike, "*E Y G"], block: int = 32
) -> Float[Array, "*E Y X"]:
    """Routed-expert MXFP4 weight: I8 nibbles (low = even column) and a per-row E8M0 scale per block."""
    vals = _e2m1_values(_unpack_nibbles(packed))
    _check_scale("dequant_fp4_rows", np.shape(scale_e8m0), (*vals.shape[:-1], _cdiv(vals.shape[-1], block)))
    return vals * jnp.repeat(_e8m0_value(scale_e8m0), block, axis=-1)[..., : vals.shape[-1]]


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_fp8_rows(
    w: Shaped[ArrayLike, "*E V H"], scale_e8m0: Shaped[ArrayLike, "*E V G"], block: int = 32
) -> Float[Array, "*E V H"]:
    """Engram table: FP8 rows with a row-wise E8M0 scale per ``block`` columns (not 32x32 tiles)."""
    w = jnp.asarray(w)
    _check_scale("dequant_fp8_rows", np.shape(scale_e8m0), (*w.shape[:-1], _cdiv(w.shape[-1], block)))
    return w.astype(jnp.float32) * jnp.repeat(_e8m0_value(scale_e8m0), block, axis=-1)[..., : w.shape[-1]]


@functools.partial(jax.jit, static_argnames=("block",))
def quantize_fp8_blocks(
    w: Float[ArrayLike, "Y X"], block: tuple[int, int] = (32, 32)
) -> tuple[Shaped[Array, "Y X"], UInt8[Array, "R C"]]:
    """Inverse of ``dequant_fp8_blocks``: the act_quant rule (spec model §2.3) over each tile.

    Equals ``qdq_fp8_ue8m0`` applied to every flattened tile, including the 1e-4 amax floor.
    """
    w = jnp.asarray(w, jnp.float32)
    (o, i), (bo, bi) = w.shape, block
    po, pi = _cdiv(o, bo) * bo, _cdiv(i, bi) * bi
    tiles = jnp.pad(w, ((0, po - o), (0, pi - i))).reshape(po // bo, bo, pi // bi, bi)
    tiles = tiles.transpose(0, 2, 1, 3).reshape(po // bo, pi // bi, bo * bi)  # zero padding leaves amax
    q, s = _fp8_ue8m0_core(tiles)
    q = q.reshape(po // bo, pi // bi, bo, bi).transpose(0, 2, 1, 3).reshape(po, pi)[:o, :i]
    return q.astype(jnp.float8_e4m3fn), _e8m0_byte(s[..., 0])


@functools.partial(jax.jit, static_argnames=("block",))
def quantize_fp4_rows(
    w: Float[ArrayLike, "*E Y X"], block: int = 32
) -> tuple[UInt8[Array, "*E Y X//2"], UInt8[Array, "*E Y G"]]:
    """Inverse of ``dequant_fp4_rows``: MXFP4 (spec attention §7.3 rule) along each row."""
    return pack_mxfp4(jnp.asarray(w, jnp.float32), block)
