"""Integer-arithmetic FP4 encoding of the TPU kernel body and of the per-group scales of the Mosaic GPU
encodes (``thresholds``; spec attention §7.2-7.4).

Every step is exact: integer ops on fp32 bit patterns, products by powers of two built from exponent
bits, and small-integer-to-float conversions. No float divide (XLA:GPU's is not correctly rounded and
moves E2M1 ties) and no fp4/fp8 casts (Mosaic GPU has none on Hopper; notes/PLATFORM.md). The steps
mirror ``dsv41_jax.quant`` (``_nvfp4_core``, ``_mxfp4_core``, ``_div_rn``, ``_round_e2m1``) so the
codes are bit-identical, including the double rounding x / s -> fp32 -> E2M1 of the reference.

Inputs are tiles split into even / odd lanes, [..., G, block//2] each, because element 2i goes in the
low nibble: the pair is packed without a lane shuffle.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (exact)."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _round_shift(m, sh):
    """m >> sh rounded half to even, for 0 <= m < 2^25 and sh >= 1 (sh clipped to 31)."""
    sh = jnp.clip(sh, 1, 31)
    kept, low, half = m >> sh, m & ((1 << sh) - 1), 1 << (sh - 1)
    return kept + ((low > half) | ((low == half) & ((kept & 1) == 1))).astype(jnp.int32)


def e2m1_code(v):
    """fp32 -> E2M1 code (int32 0..15) with round-half-even and saturation at ±6; bit 3 = sign of v.

    Quantum 2^q with q = -1 below 2, 0 in [2, 4), 1 from 4; the number of quanta n maps to the code
    index as n, n + 2, min(n + 4, 7) (same parity argument as quant._round_e2m1). Subnormal v is zero.
    """
    b = _bits(v)
    e = (b >> 23) & 0xFF
    m = (b & 0x7FFFFF) | 0x800000
    q = jnp.where(e < 128, -1, jnp.where(e < 129, 0, 1))
    n = jnp.where(e == 0, 0, _round_shift(m, q + 150 - e))  # v = m * 2^(e-150); quanta = v / 2^q
    idx = jnp.where(q == -1, n, jnp.where(q == 0, n + 2, jnp.minimum(n + 4, 7)))
    return idx | ((b >> 28) & 8)  # the arithmetic shift keeps bit 3 = sign; the mask drops the rest


def div_rn_by_short(x, d):
    """x / d rounded to nearest even (fp32), d a normal fp32 with <= 4 significant bits.

    Integer long division of the significands, as quant._div_rn. The quotient of a 30-bit dividend by
    a divisor in [8, 15] has 26 or 27 bits, so the shift to 24 kept bits is 2 or 3 (no clz needed).
    ``d`` may be a Python float: its significand and exponent are then constants, and the compiler turns
    the division by a constant into a multiply (the group scale divides by 6 once per group).
    """
    xb = _bits(x)
    db = int(np.float32(d).view(np.int32)) if isinstance(d, float) else _bits(d)
    ed, dd = (db >> 23) & 0xFF, ((db >> 20) & 7) | 8
    ex = (xb >> 23) & 0xFF
    n = ((xb & 0x7FFFFF) | 0x800000) << 6
    quo, rem = lax.div(n, dd), lax.rem(n, dd)
    shift = 2 + (quo >= (1 << 26)).astype(jnp.int32)
    kept, low, half = quo >> shift, quo & ((1 << shift) - 1), 1 << (shift - 1)
    up = (low > half) | ((low == half) & ((rem != 0) | ((kept & 1) == 1)))
    mag = (kept + up.astype(jnp.int32)).astype(jnp.float32) * _pow2(jnp.clip(ex - ed - 26 + shift, -126, 127))
    mag = jnp.where(ex == 0, 0.0, mag)  # zero and flushed subnormals
    # the sign bit of x is ORed in (not ``where(x < 0, -mag, mag)``): a negative x whose quotient rounds to
    # zero must give -0, and a compiler may fold the negation of a zero away
    return lax.bitcast_convert_type(_bits(mag) | ((xb >> 31) << 31), jnp.float32)


def e4m3_rn(a):
    """Positive fp32 -> (nearest E4M3 value as fp32, its byte as int32), saturating at 448.

    3 mantissa bits; binades below 2^-6 share the subnormal quantum 2^-9.
    """
    e = (_bits(a) >> 23) & 0xFF
    eq = jnp.maximum(e - 127, -6)
    n = _round_shift((_bits(a) & 0x7FFFFF) | 0x800000, eq + 147 - e)  # quanta of 2^(eq-3), <= 16
    s = jnp.minimum(n.astype(jnp.float32) * _pow2(eq - 3), E4M3_MAX)
    sb = _bits(s)
    es = (sb >> 23) & 0xFF
    byte = jnp.where(es < 121, n, ((es - 120) << 3) | ((sb >> 20) & 7))  # below 2^-6: subnormal byte = n
    return s, byte


def _pack(even, odd):
    return (even & 0xF) | ((odd & 0xF) << 4)


def nvfp4_tile(even, odd):
    """Even / odd lanes [..., G, 8] fp32 -> (packed nibbles int32 [..., G, 8], E4M3 bytes int32 [..., G])."""
    amax = jnp.maximum(jnp.max(jnp.abs(even), -1), jnp.max(jnp.abs(odd), -1))
    amax = jnp.maximum(amax, jnp.float32(E2M1_MAX * 2.0**-9))  # spec attention §7.2 floor
    s, byte = e4m3_rn(div_rn_by_short(amax, E2M1_MAX))
    s = s[..., None]

    def code(x):
        return e2m1_code(jnp.clip(div_rn_by_short(x, jnp.broadcast_to(s, x.shape)), -E2M1_MAX, E2M1_MAX))

    return _pack(code(even), code(odd)), byte


def mxfp4_tile(even, odd):
    """Even / odd lanes [..., G, 16] fp32 -> (packed nibbles int32 [..., G, 16], E8M0 bytes int32 [..., G])."""
    amax = jnp.maximum(jnp.max(jnp.abs(even), -1), jnp.max(jnp.abs(odd), -1))
    t = jnp.maximum(amax, jnp.float32(E2M1_MAX * 2.0**-126)) * jnp.float32(1 / E2M1_MAX)  # spec attention §7.3
    tb = _bits(t)
    e = ((tb >> 23) & 0xFF) - 127 + ((tb & 0x7FFFFF) != 0).astype(jnp.int32)  # ceil(log2 t)
    inv = _pow2(jnp.maximum(-e, -126))[..., None]  # x / 2^e as an exact product
    return _pack(e2m1_code(even * inv), e2m1_code(odd * inv)), e + 127
