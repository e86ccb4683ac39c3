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


def empty(lead, n: int, block: int, fmt: str):
    """Outputs for zero rows (a grid of zero steps is not launched)."""
    packed = jnp.zeros((0, n // block, block // 2), jnp.uint8)
    return join(lead, packed, jnp.zeros((0, n // block), jnp.uint8), fmt)


def row_tile(rows: int, want: int) -> int:
    """Rows per grid step: ``want`` (a power of two), or all rows when there are fewer."""
    return rows if rows <= want else want
