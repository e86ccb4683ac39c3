"""Integer-arithmetic FP4 decoding shared by the TPU and Mosaic GPU unpack kernels (``tpu``, ``mosaic``;
spec attention §7.2-7.4).

The inverse of ``encode``: codes and scale bytes become fp32 by building the bit patterns, never through
a table gather (no Pallas lowering of a gather from a constant on GPU) or an fp8 cast (Mosaic GPU has
none on Hopper; notes/PLATFORM.md). The value is then ``element * scale`` in fp32, the same single
product ``quant.unpack_*`` computes, so the result (and the platform's handling of subnormal products,
possible only for E8M0 bytes 0 and 1) is that of the reference.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_QUIET_NAN = 0x7FC00000


def _f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def e2m1_value(code):
    """E2M1 code (int32 0..15, bit 3 = sign) -> fp32 grid value; code 8 is -0 as in the reference.

    Magnitude index i >= 2 is (1 + (i & 1) / 2) * 2^((i >> 1) - 1); i = 1 is 0.5 and i = 0 is 0.
    """
    i = code & 7
    mag = jnp.where(i >= 2, (((i >> 1) + 126) << 23) | ((i & 1) << 22), jnp.where(i == 1, 126 << 23, 0))
    return _f32(mag | ((code & 8) << 28))


def e4m3_value(byte):
    """float8_e4m3fn byte (int32 0..255) -> fp32, as the dtype conversion does: 2^-9 subnormal quantum,
    S.1111.111 is NaN (no infinities)."""
    e, m = (byte >> 3) & 15, byte & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = lax.bitcast_convert_type(m.astype(jnp.float32) * jnp.float32(2.0**-9), jnp.int32)  # exact
    mag = jnp.where((e == 15) & (m == 7), _QUIET_NAN, jnp.where(e == 0, sub, normal))
    return _f32(mag | ((byte & 0x80) << 24))


def e8m0_value(byte):
    """E8M0 byte (int32 0..255) -> fp32 2^(b-127), exactly ``quant._e8m0_value`` (0: 2^-127, 255: NaN)."""
    return _f32(jnp.where(byte == 0, 1 << 22, jnp.where(byte == 255, _QUIET_NAN, byte << 23)))


SCALE_FNS = {"nvfp4": e4m3_value, "mxfp4": e8m0_value}


def unpack_tile(packed, scale_bytes, fmt: str):
    """Packed nibbles [..., G, block//2] and scale bytes [..., G] (int32) -> (even, odd) fp32 lanes.

    Element 2i is the low nibble (spec attention §7.4); each is its grid value times the group's scale.
    """
    scale = SCALE_FNS[fmt](scale_bytes)[..., None]
    return e2m1_value(packed & 0xF) * scale, e2m1_value(packed >> 4) * scale
