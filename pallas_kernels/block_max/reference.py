"""XLA reference for block_max: the block maxima of candidate selection (spec attention §6.1 steps 1-2).

This is the model's path (``indexer.candidate_block_ids`` calls ``api`` with its ``kernel_backend``);
tests/model/test_indexer.py pins it to a per-query loop over the spec.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def block_max(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], block_size: int) -> Float[Array, "B S NB"]:
    """Per-block maxima over ``block_size`` positions (−∞ padded), the newest visible block pinned to +∞."""
    b, s, t = scores.shape
    nb = -(-t // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * block_size - t)), constant_values=-jnp.inf)
    bmax = padded.reshape(b, s, nb, block_size).max(-1)  # [B, S, NB]
    newest = (n_visible - 1) // block_size
    pinned = (jnp.arange(nb) == newest[..., None]) & (n_visible[..., None] > 0)
    return jnp.where(pinned, jnp.inf, bmax)

