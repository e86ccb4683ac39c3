"""XLA reference for block_max: the first half of ``indexer.candidate_block_ids`` (spec attention §6.1)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dsv41_jax.model import indexer


def block_max(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], block_size: int) -> Float[Array, "B S NB"]:
    """Per-block maxima over ``block_size`` positions (−∞ padded), the newest visible block pinned to +∞."""
    b, s, t = scores.shape
    nb = -(-t // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * block_size - t)), constant_values=-jnp.inf)
    bmax = padded.reshape(b, s, nb, block_size).max(-1)  # [B, S, NB]
    newest = (n_visible - 1) // block_size
    pinned = (jnp.arange(nb) == newest[..., None]) & (n_visible[..., None] > 0)
    return jnp.where(pinned, jnp.inf, bmax)


def candidate_block_ids(scores, n_visible, block_size: int, n_blocks: int):
    return indexer.candidate_block_ids(scores, n_visible, block_size, n_blocks)
