"""fp4_pack on TPU through Mosaic TPU (``pltpu``); runs on CPU with ``interpret=True``.

One grid step quantises ``rows_per_step`` rows: read the latents once, write nibbles and scale bytes
once (the floor is bytes moved / copy bandwidth). The input arrives as [R, G, block//2, 2] so the even
and odd lanes of each pair are separate operands and packing needs no lane shuffle.

Untested on TPU hardware: the trailing pair axis of 2 occupies a full lane tile on Mosaic TPU, so a
TPU-tuned version should load [tr, N] and de-interleave with strided lane loads; the arithmetic in
``encode`` carries over unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fp4_pack import encode, layout

_TILE_FNS = {"nvfp4": encode.nvfp4_tile, "mxfp4": encode.mxfp4_tile}


def _kernel(x_ref, codes_ref, scales_ref, *, fmt: str):
    x = x_ref[...].astype(jnp.float32)  # [tr, G, block//2, 2]
    packed, byte = _TILE_FNS[fmt](x[..., 0], x[..., 1])
    codes_ref[...] = packed.astype(jnp.uint8)
    scales_ref[...] = byte.astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "interpret"))
def pack(x, fmt: str, *, rows_per_step: int = 256, interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit."""
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    xp = layout.split_pairs(x, block)
    r, g, h, _ = xp.shape
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    tr = layout.row_tile(r, rows_per_step)
    codes, scales = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt),
        out_shape=(jax.ShapeDtypeStruct((r, g, h), jnp.uint8), jax.ShapeDtypeStruct((r, g), jnp.uint8)),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0))],
        out_specs=(pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(xp)
    return layout.join(lead, codes, scales, fmt)
