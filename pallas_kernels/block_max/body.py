"""The block-max tile computation of the TPU kernel, ``tpu.py`` (spec attention §6.1 steps 1-2); the
Mosaic GPU kernel (``mosaic.py``) computes the same maxima on its register layout."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def block_max_tile(s, n, j, *, block_size: int, length: int):
    """Scores tile [tr, tt] at position tile j -> block maxima [tr, tt // block_size], newest block +∞.

    Positions at or past ``length`` (the ragged tail, and whatever the last grid step reads out of
    bounds) count as −∞, which is the reference's padding. ``n`` holds n_p per row as [tr, 1].
    """
    tr, tt = s.shape
    nbt = tt // block_size
    pos = j * tt + lax.broadcasted_iota(jnp.int32, (tr, tt), 1)
    s = jnp.where(pos < length, s, jnp.asarray(-jnp.inf, s.dtype))
    bmax = jnp.max(s.reshape(tr, nbt, block_size), axis=-1)  # [tr, nbt]
    blk = j * nbt + lax.broadcasted_iota(jnp.int32, (tr, nbt), 1)
    pinned = (blk == lax.div(n - 1, block_size)) & (n > 0)  # truncation at n = 0 is masked by n > 0
    return jnp.where(pinned, jnp.asarray(jnp.inf, s.dtype), bmax)
