"""E2M1 codes by comparing |x| with per-group thresholds: the cheap per-element form of ``encode``.

``encode.e2m1_code(div_rn(x, s))`` costs ~90 integer ops per element (long division, then rounding on
the bit pattern), which makes a GPU kernel ALU-bound far above its byte floor. Here each element costs
7 compares: the code index counts the E2M1 midpoints mu that |x| passes,

    idx = sum_{mu in DOWN} [|x| > mu s] + sum_{mu in UP} [|x| >= mu s],

UP being the midpoints whose tie rounds to the upper (even) code (0.75, 1.75, 3.5) and DOWN the others
(0.25, 1.25, 2.5, 5); idx saturates at 7 = ±6, which is the reference's clip. ``mu s`` is exact in fp32
(<= 3 + 4 significant bits) and computed once per group.

Why this equals the reference's double rounding x / s -> fp32 (round to nearest) -> E2M1 (half to even):
the fp32 quotient can only differ from the exact one across a midpoint mu when the exact quotient lies
within half an fp32 ulp of mu, i.e. |x| within h = (ulp(mu) / 2) s of mu s. For these mu, h / (mu s)
<= 2^-24 while the gap between mu s and its fp32 neighbours is > 2^-24 (mu s) on both sides (mu s is
never a power of two, and for mu = 0.25 the gap above is the larger one): no fp32 |x| lies in that
window, so the double rounding never moves a code (checked exhaustively for every bf16 |x| and every
E4M3 scale in tests/kernels/test_mosaic_gpu.py). MXFP4 scales are powers of two, x / s is exact, and
the same compares apply with mu 2^e.

The reference computes on XLA:CPU, which flushes subnormal inputs to zero; a GPU kernel does not, so
subnormal |x| must count as zero: NVFP4 thresholds are >= 0.25 * 2^-9 (normal), MXFP4 thresholds are
floored at 2^-126.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp4_pack import encode

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TIE_UP = (False, True, False, True, False, True, False)  # tie at mu goes to the upper code (even index)
TINY_BITS = 0x00800000  # 2^-126, the smallest normal fp32


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _f32(b):
    return lax.bitcast_convert_type(b, jnp.float32)


def code_index(a, thresholds):
    """|x| fp32 -> E2M1 magnitude index 0..7 (int32): the number of thresholds with |x| >= t."""
    idx = None
    for t in thresholds:
        hit = (a >= t).astype(jnp.int32)
        idx = hit if idx is None else idx + hit
    return idx


def code_index_bsearch(a, thresholds):
    """:func:`code_index` by a binary search over the 7 non-decreasing thresholds: 3 compares and 3 selects
    of a threshold per element instead of 7 compares and 7 adds. The count #{t <= a} is the same for any
    non-decreasing thresholds whose NaN patterns (MXFP4 scales past the fp32 range) come last, as here: the
    compare with a NaN is false, as it is for a threshold above a."""
    t1, t2, t3, t4, t5, t6, t7 = thresholds
    c4 = a >= t4
    c2 = a >= jnp.where(c4, t6, t2)
    c1 = a >= jnp.where(c4, jnp.where(c2, t7, t5), jnp.where(c2, t3, t1))
    return (c4.astype(jnp.int32) << 2) | (c2.astype(jnp.int32) << 1) | c1.astype(jnp.int32)


def _from_bits(bits):
    """Threshold bit patterns for mu = MIDPOINTS: ties down become the next float up (|x| > t <=> |x| >= t+)."""
    return [_f32(b if up else b + 1) for b, up in zip(bits, TIE_UP, strict=True)]


def nvfp4_scale(amax):
    """Group amax (fp32) -> (E4M3 scale as fp32, its byte as int32): e4m3(amax / 6), spec attention §7.2."""
    amax = jnp.maximum(amax, jnp.float32(encode.E2M1_MAX * 2.0**-9))
    return encode.e4m3_rn(encode.div_rn_by_short(amax, encode.E2M1_MAX))


def nvfp4_thresholds(s):
    """E4M3 scale values (>= 2^-9) -> the 7 thresholds from mu * s (exact products, all normal)."""
    return _from_bits([_bits(s * jnp.float32(mu)) for mu in MIDPOINTS])


def mxfp4_scale(amax):
    """Group amax (fp32) -> exponent e of the E8M0 scale 2^e (int32, in [-126, 126] for finite amax)."""
    t = jnp.maximum(amax, jnp.float32(encode.E2M1_MAX * 2.0**-126)) * jnp.float32(1 / encode.E2M1_MAX)
    tb = _bits(t)
    return ((tb >> 23) & 0xFF) - 127 + ((tb & 0x7FFFFF) != 0).astype(jnp.int32)  # ceil(log2 t), spec §7.3


def mxfp4_thresholds(e):
    """Scale exponents -> the 7 thresholds from mu * 2^e, built on the bit patterns (exponent add), floored
    at 2^-126 so that subnormal |x| counts as zero. Past the fp32 range a threshold becomes a NaN
    pattern, which no finite |x| reaches (as intended: |x| / 2^126 < 4)."""
    base = [(int(np.float32(mu).view(np.int32)) + (e << 23)) for mu in MIDPOINTS]
    out = []
    for b, up in zip(base, TIE_UP, strict=True):
        out.append(_f32(jnp.maximum(b if up else b + 1, TINY_BITS)))
    return out


def group_scale(fmt: str, amax):
    """Group amax (fp32) -> (the scale byte as int32: E4M3 for nvfp4, E8M0 for mxfp4, and the 7 thresholds)."""
    if fmt == "nvfp4":
        s, byte = nvfp4_scale(amax)
        return byte, nvfp4_thresholds(s)
    e = mxfp4_scale(amax)
    return e + 127, mxfp4_thresholds(e)
