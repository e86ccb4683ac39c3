"""block_max on GPU through the Pallas Triton lowering (deprecated in jax 0.11): a comparison only.

``api.py`` runs the Mosaic GPU kernel (``mosaic.py``) on GPU. This one came first, when the Triton lowering
was the one whose output could be checked on a CPU-only jaxlib, and is kept because ``bench.py`` times it
beside the Mosaic kernel and XLA on the device (they are within 10–25% of each other; BENCHMARKS.md).

Triton needs power-of-two block shapes: row and position tiles are powers of two, so ``block_size``
must be one too (8 in the release). The Pallas Triton lowering does not mask blocks that overhang the
array (a plain ``ref[...]`` is an unmasked pointer load), so loads and stores carry explicit row and
position masks; masked-off scores read as −∞, the reference's padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_max import body


def _kernel(n_ref, s_ref, o_ref, *, block_size: int, rows: int, length: int):
    i, j = pl.program_id(0), pl.program_id(1)
    tr, tt = s_ref.shape
    nbt = tt // block_size
    row_ok = i * tr + lax.broadcasted_iota(jnp.int32, (tr, 1), 0) < rows  # [tr, 1]
    pos_ok = j * tt + lax.broadcasted_iota(jnp.int32, (tr, tt), 1) < length
    s = pltriton.load(s_ref, mask=row_ok & pos_ok, other=-jnp.inf)  # [tr, tt]
    n = pltriton.load(n_ref, mask=row_ok, other=0)
    out = body.block_max_tile(s, n, j, block_size=block_size, length=length)
    blk_ok = j * nbt + lax.broadcasted_iota(jnp.int32, (tr, nbt), 1) < -(-length // block_size)
    pltriton.store(o_ref, out, mask=row_ok & blk_ok)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(
    jax.jit, static_argnames=("block_size", "rows_per_step", "blocks_per_step", "num_warps", "interpret"))
def block_max(scores, n_visible, block_size: int, *, rows_per_step: int = 4, blocks_per_step: int = 256,
              num_warps: int = 4, interpret: bool = False):
    """[B, S, T] scores, [B, S] n_p -> [B, S, ceil(T / block_size)] maxima, equal to reference.block_max."""
    b, s, t = scores.shape
    nb = -(-t // block_size)
    r = b * s
    if r == 0 or t == 0:
        return jnp.full((b, s, nb), -jnp.inf, scores.dtype)
    if block_size & (block_size - 1):
        raise ValueError(f"block_max gpu: block_size ({block_size}) must be a power of two for Triton blocks")
    tr = _pow2_at_least(min(r, rows_per_step))
    nbt = _pow2_at_least(min(nb, blocks_per_step))
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, rows=r, length=t),
        out_shape=jax.ShapeDtypeStruct((r, nb), scores.dtype),
        grid=(pl.cdiv(r, tr), pl.cdiv(nb, nbt)),
        in_specs=[pl.BlockSpec((tr, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((tr, nbt * block_size), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((tr, nbt), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(n_visible.reshape(r, 1).astype(jnp.int32), scores.reshape(r, t))
    return out.reshape(b, s, nb)
