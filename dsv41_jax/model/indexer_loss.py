"""Indexer training signal: KL to the main attention's entry distribution, and top-k agreement.

V4.1's indexer objective is not published (spec model §9.5, §11.4; spec attention §7.6: NeMo freezes the
indexer). We use DeepSeek-V3.2's: for each index source, the target over compressed entries is the main
attention's probability mass summed over heads and L1-normalised, without gradient, and the loss is
``KL(target ‖ softmax(indexer scores))`` per query, over one of two supports:

- ``dense``: every entry the query may see (V3.2's dense warm-up). The target needs one extra forward-only
  pass of the main query over all visible entries (:func:`dsv41_jax.model.sparse.entry_mass`). This is the
  default: an indexer trained from scratch starts with an arbitrary selection, and only the dense support
  tells it that an entry it did not pick deserved attention.
- ``topk``: the entries it selected (V3.2's sparse stage); the target is the probability the sparse
  attention actually gave them, so the loss needs no extra pass. Meant for long context once the indexer
  is good; it can only re-rank its own picks. (The agreement metric below still runs the dense pass
  whenever stats are asked for; at long context it would have to be sampled.)

The indexer is detached from the main model (as in V3.2): its inputs (the block input, the query latent,
the compressor latent) carry no gradient back, so it learns only from this loss and the main model gets
none from it. Its output is a hard top-k, so the LM loss never reached it anyway.

Agreement is the share of the (dense) main attention mass over compressed entries that falls inside the
indexer's top-k selection: 1.0 means the selection holds every entry the main attention would use.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.model.indexer import block_mask

TARGETS = ("dense", "topk")


class IndexerStats(NamedTuple):
    """Per query of one index source."""

    kl: Float[Array, "B S"]  # KL(target ‖ indexer) in nats; 0 where the query sees no entry
    agreement: Float[Array, "B S"]  # main attention mass inside the top-k / mass over visible entries
    valid: Bool[Array, "B S"]  # the query sees at least one compressed entry


def masked_log_softmax(scores: Float[Array, "*B T"], support: Bool[Array, "*B T"]) -> Float[Array, "*B T"]:
    """log softmax over ``support`` (0 outside it and on rows with an empty support; finite gradients)."""
    some = support.any(-1, keepdims=True)
    s = jnp.where(support & some, scores, -jnp.inf)
    s = jnp.where(some, s, 0.0)
    return jnp.where(support, jax.nn.log_softmax(s, axis=-1), 0.0)


def kl_to_target(mass: Float[Array, "*B T"], scores: Float[Array, "*B T"], support: Bool[Array, "*B T"]
                 ) -> Float[Array, "*B"]:
    """``Σ_t p_t (log p_t − log q_t)`` over ``support``: ``p = mass / Σ mass`` (no gradient),
    ``q = softmax(scores)``."""
    mass = jax.lax.stop_gradient(jnp.where(support, mass, 0.0))
    total = mass.sum(-1, keepdims=True)
    p = mass / jnp.where(total > 0, total, 1.0)
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    log_q = masked_log_softmax(scores, support)
    return jnp.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def indexer_stats(target: str, scores: Float[Array, "B S T"], visible: Bool[Array, "B S T"],
                  dense_mass: Float[Array, "B S T"], topk: Int[Array, "B S K"],
                  topk_mass: Float[Array, "B S K"] | None = None) -> IndexerStats:
    """The KL of ``target`` (``dense`` | ``topk``) and the agreement of one index source, per query.

    ``scores`` are the indexer's scores before any candidate restriction; ``dense_mass`` and ``topk_mass``
    are the main attention's head-summed mass over the visible entries and over the picks.
    """
    if target not in TARGETS:
        raise ValueError(f"indexer target must be one of {TARGETS}, got {target!r}")
    valid = visible.any(-1)
    if target == "dense":
        kl = kl_to_target(dense_mass, scores, visible)
    else:
        picked = topk >= 0
        kl = kl_to_target(topk_mass, jnp.take_along_axis(scores, jnp.maximum(topk, 0), axis=-1), picked)
    dense_mass = jax.lax.stop_gradient(jnp.where(visible, dense_mass, 0.0))
    total = dense_mass.sum(-1)
    inside = jnp.where(block_mask(topk, scores.shape[-1]), dense_mass, 0.0).sum(-1)
    agreement = jnp.where(total > 0, inside / jnp.where(total > 0, total, 1.0), 0.0)
    return IndexerStats(jnp.where(valid, kl, 0.0), jnp.where(valid, agreement, 0.0), valid)
