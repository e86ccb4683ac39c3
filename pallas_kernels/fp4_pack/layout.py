"""Host-side views shared by the kernels: free reshapes between [..., N] and the kernel's row tiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

FORMATS = {"nvfp4": 16, "mxfp4": 32}  # group size of each format (spec attention §7.2, §7.3)


def split_pairs(x, block: int):
    """[..., N] -> [R, G, block//2, 2] (a bitcast-free reshape: lane 2i+j lands at [..., i, j])."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp4_pack: the last axis ({n}) must be a multiple of the group size ({block})")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return x.reshape(rows, n // block, block // 2, 2)


def join(lead, packed, scales, fmt: str):
    """Kernel outputs [R, G, block//2] uint8 and [R, G] uint8 -> the reference's dtypes and shapes."""
    packed = packed.reshape(*lead, packed.shape[-2] * packed.shape[-1])
    scales = scales.reshape(*lead, scales.shape[-1])
    if fmt == "nvfp4":
        scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)  # the kernel wrote raw E4M3 bytes
    return packed, scales


def split_codes(codes, scales, block: int):
    """[..., N/2] nibbles and [..., G] scale bytes (any 1-byte dtype) -> [R, G, block//2] and [R, G] uint8."""
    g = scales.shape[-1]
    if codes.shape[-1] != g * block // 2 or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"fp4_pack: codes {codes.shape} and scales {scales.shape} do not describe groups of "
                         f"{block} lanes (codes [..., G*{block // 2}], scales [..., G])")
    rows = int(np.prod(codes.shape[:-1], dtype=np.int64))
    return as_bytes(codes).reshape(rows, g, block // 2), as_bytes(scales).reshape(rows, g)


def as_bytes(x):
    """A 1-byte array (uint8, float8_e4m3fn, ...) viewed as uint8 (a free bitcast)."""
    return x if x.dtype == jnp.uint8 else lax.bitcast_convert_type(x, jnp.uint8)


def from_bytes(x, dtype):
    """The inverse view of :func:`as_bytes`."""
    return x if dtype == jnp.uint8 else lax.bitcast_convert_type(x, dtype)


def cache_slots(index, length: int):
    """Row index [B, S] -> slot in [0, length], ``length`` meaning "not written".

    The reference writes with ``.at[index].set(mode="drop")``: an index in [-length, 0) counts from the
    end, anything else out of range is dropped; the kernels see only the normalised slot.
    """
    index = index.astype(jnp.int32)
    index = jnp.where(index < 0, index + length, index)
    return jnp.where((index >= 0) & (index < length), index, length)


def empty(lead, n: int, block: int, fmt: str):
    """Outputs for zero rows (a grid of zero steps is not launched)."""
    packed = jnp.zeros((0, n // block, block // 2), jnp.uint8)
    return join(lead, packed, jnp.zeros((0, n // block), jnp.uint8), fmt)


def row_tile(rows: int, want: int) -> int:
    """Rows per grid step: ``want`` (a power of two), or all rows when there are fewer."""
    return rows if rows <= want else want
