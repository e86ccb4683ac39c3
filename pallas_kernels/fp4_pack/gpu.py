"""fp4_pack on GPU through the Pallas Triton lowering.

Why Triton and not Mosaic GPU (the supported path in jax 0.11): this kernel was written without a GPU
to test on, and the Triton lowering of a plain ``pallas_call`` is the one whose lowering can be checked
on a CPU-only jaxlib (``lower(lowering_platforms=("cuda",))`` emits Triton IR without a device) and
whose body is shared, op for op, with the TPU kernel that interpret mode validates bit for bit. Mosaic
GPU needs ``plgpu.kernel`` with explicit warpgroup layouts and SMEM/TMA staging that cannot be
validated here. The body already meets Mosaic GPU's constraints on Hopper (integer-arithmetic E2M1 and
E4M3 encoding, no fp4/fp8 casts, no float divide), so a port only changes the memory plumbing; do it
once the GPU tests here pass and bench.py gives the Triton baseline.

Triton needs power-of-two block shapes: the row tile is rounded up to one, and G, block//2 and 2 are
powers of two for both formats. The Pallas Triton lowering does not mask blocks that overhang the array
(a plain ``ref[...]`` is an unmasked pointer load), so the last row tile loads and stores with an
explicit row mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp4_pack import encode, layout

_TILE_FNS = {"nvfp4": encode.nvfp4_tile, "mxfp4": encode.mxfp4_tile}


def _kernel(x_ref, codes_ref, scales_ref, *, fmt: str, rows: int):
    tr, g, h, _ = x_ref.shape

    def live(*shape):  # rows of the (possibly overhanging) last tile that exist
        return pl.program_id(0) * tr + lax.broadcasted_iota(jnp.int32, (tr, *shape), 0) < rows

    def lanes(j):  # one stride-2 load per pair member, so packing needs no lane shuffle (Triton has no
        # lowering for a value slice, and an int index on the masked ref view fails in interpret mode)
        v = pltriton.load(x_ref.at[:, :, :, pl.ds(j, 1)], mask=live(g, h, 1), other=0)
        return v.reshape(tr, g, h).astype(jnp.float32)  # [tr, G, block//2]

    packed, byte = _TILE_FNS[fmt](lanes(0), lanes(1))
    pltriton.store(codes_ref, packed.astype(jnp.uint8), mask=live(g, h))
    pltriton.store(scales_ref, byte.astype(jnp.uint8), mask=live(g))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "num_warps", "interpret"))
def pack(x, fmt: str, *, rows_per_step: int = 16, num_warps: int = 4, interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit."""
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    xp = layout.split_pairs(x, block)
    r, g, h, _ = xp.shape
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    if g & (g - 1):
        raise ValueError(f"fp4_pack gpu: groups per row ({g}) must be a power of two for Triton blocks")
    tr = _pow2_at_least(min(r, rows_per_step))
    codes, scales = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, rows=r),
        out_shape=(jax.ShapeDtypeStruct((r, g, h), jnp.uint8), jax.ShapeDtypeStruct((r, g), jnp.uint8)),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0))],
        out_specs=(pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(xp)
    return layout.join(lead, codes, scales, fmt)
