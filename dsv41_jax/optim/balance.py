"""MoE load balancing outside the optimizer: the aux-loss-free bias rule and the sequence balance loss.

Spec model §5.3 (V3's rule, [INF] for V4.1): after each step, for every expert i and modality m,
``b_i^m ← b_i^m + γ·sign(mean_j load_j^m − load_i^m)`` with γ = 0.001, load counted over that modality's
tokens only (``bias`` for text, ``bias_vl`` for image tokens). Plus ``L_bal = α Σ_i f_i P_i`` per sequence,
α = 1e-4. Pure functions: the train step calls them with the forward's :class:`Routing`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.model.moe import Routing
from dsv41_jax.optim.labels import path_name

_BIAS = re.compile(r"(?:^|\.)layers\.(\d+)\.ffn\.gate\.(bias|bias_vl)$")


def expert_load(experts: Int[Array, "*B K"], n_experts: int,
                weight: Float[Array, "*B"] | Bool[Array, "*B"] | None = None) -> Float[Array, "E"]:
    """Tokens routed to each expert (each of a token's K picks counts once), optionally only weighted tokens."""
    k = experts.shape[-1]
    w = jnp.ones(experts.shape[:-1], jnp.float32) if weight is None else weight.astype(jnp.float32)
    return jnp.bincount(experts.reshape(-1), weights=jnp.repeat(w.reshape(-1), k), length=n_experts)


def aux_free_bias_update(bias: Float[Array, "E"], load: Float[Array, "E"], speed: float) -> Float[Array, "E"]:
    """``b ← b + speed·sign(mean(load) − load)``: overloaded experts become less likely to be picked."""
    return bias + speed * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)


def modality_weights(valid: Bool[Array, "B S"] | None, is_image: Bool[Array, "B S"] | None,
                     shape: tuple[int, ...]) -> tuple[Float[Array, "B S"], Float[Array, "B S"]]:
    """(text, image) token weights: valid non-image and valid image positions."""
    valid = jnp.ones(shape, bool) if valid is None else valid
    image = jnp.zeros(shape, bool) if is_image is None else is_image
    return (valid & ~image).astype(jnp.float32), (valid & image).astype(jnp.float32)


def router_bias_update(biases, routing: Sequence[Routing], speed: float, *,
                       is_image: Bool[Array, "B S"] | None = None, valid: Bool[Array, "B S"] | None = None):
    """The aux-loss-free step for every router bias in ``biases``.

    ``biases`` is a tree of the model's ``RouterBias`` variables (``nnx.state(model, RouterBias)``) named like
    the checkpoint (``layers.3.ffn.gate.bias``); ``routing[i]`` is layer i's routing of this step's batch.
    A modality without tokens in the batch leaves its bias unchanged (all loads 0).
    """

    def step(path, bias):
        hit = _BIAS.search(path_name(path))
        if hit is None:
            raise ValueError(f"{path_name(path)!r} is not a router bias (layers.<i>.ffn.gate.bias / bias_vl)")
        r = routing[int(hit.group(1))]
        text, image = modality_weights(valid, is_image, r.experts.shape[:-1])
        load = expert_load(r.experts, bias.shape[-1], image if hit.group(2) == "bias_vl" else text)
        return aux_free_bias_update(bias, load, speed)

    return jax.tree_util.tree_map_with_path(step, biases)


def sequence_balance_loss(scores: Float[Array, "B S E"], experts: Int[Array, "B S K"], alpha: float,
                          valid: Bool[Array, "B S"] | None = None) -> Float[Array, ""]:
    """V3's sequence-wise loss ``α Σ_i f_i P_i``, averaged over the sequences that have tokens (spec §5.3).

    ``f_i = E/(K·T)·#{t : i ∈ topk_t}`` (a count, no gradient), ``P_i = (1/T) Σ_t s_{i,t}/Σ_j s_{j,t}`` on the
    unbiased affinities; T = the sequence's valid tokens.
    """
    b, s, e = scores.shape
    k = experts.shape[-1]
    w = jnp.ones((b, s), jnp.float32) if valid is None else valid.astype(jnp.float32)
    t = jnp.maximum(w.sum(-1, keepdims=True), 1.0)  # [B, 1]
    counts = jax.vmap(lambda ex, wt: expert_load(ex, e, wt))(experts, w)  # [B, E]
    f = jax.lax.stop_gradient(counts * e / (k * t))
    p = jnp.einsum("bs,bse->be", w, scores / scores.sum(-1, keepdims=True)) / t
    per_seq = (f * p).sum(-1)  # [B]
    has_tokens = (w.sum(-1) > 0).astype(jnp.float32)
    return alpha * (per_seq * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)


def balance_loss(routing: Sequence[Routing], alpha: float, valid: Bool[Array, "B S"] | None = None,
                 ) -> Float[Array, ""]:
    """:func:`sequence_balance_loss` summed over the MoE layers (each layer balanced on its own) [INF]."""
    return sum(sequence_balance_loss(r.scores, r.experts, alpha, valid) for r in routing)
