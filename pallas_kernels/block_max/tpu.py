"""block_max on TPU through Mosaic TPU (``pltpu``); runs on CPU with ``interpret=True``.

A 2-D grid over (row tiles, position tiles): each step reads ``tr x tt`` scores once and writes
``tr x tt / block_size`` maxima, so the floor is the score read (4 B per position for f32). Both axes
are independent (no carry between steps), hence both ``parallel``. Untested on TPU hardware; the
in-register reshape to [tr, nbt, block_size] puts block_size (8) on the lane axis, which Mosaic may
relayout; a strided-lane max over 8 loads is the fallback if it does not lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_max import body


def _kernel(n_ref, s_ref, o_ref, *, block_size: int, length: int):
    o_ref[...] = body.block_max_tile(s_ref[...], n_ref[...], pl.program_id(1), block_size=block_size,
                                     length=length)


@functools.partial(jax.jit, static_argnames=("block_size", "rows_per_step", "blocks_per_step", "interpret"))
def block_max(scores, n_visible, block_size: int, *, rows_per_step: int = 8, blocks_per_step: int = 1024,
              interpret: bool = False):
    """[B, S, T] scores, [B, S] n_p -> [B, S, ceil(T / block_size)] maxima, equal to reference.block_max."""
    b, s, t = scores.shape
    nb = -(-t // block_size)
    r = b * s
    if r == 0 or t == 0:
        return jnp.full((b, s, nb), -jnp.inf, scores.dtype)
    tr = min(r, rows_per_step)
    nbt = nb if nb <= blocks_per_step else blocks_per_step  # full extent, or a multiple of 128 lanes
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, length=t),
        out_shape=jax.ShapeDtypeStruct((r, nb), scores.dtype),
        grid=(pl.cdiv(r, tr), pl.cdiv(nb, nbt)),
        in_specs=[pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((tr, nbt * block_size), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((tr, nbt), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(n_visible.reshape(r, 1).astype(jnp.int32), scores.reshape(r, t))
    return out.reshape(b, s, nb)
