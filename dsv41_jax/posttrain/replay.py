"""The served forward as a differentiable training forward: CED prefill and SWA bounded replay (spec §9).

The engine serves a prompt of ``N`` tokens whose first ``h`` tokens hit the prefix cache like this
(``engine.prefill``: ``prefill(mode='ced')`` of the prefix, then ``replay_after_hit`` with CED options):

* the prefix's **global KV** (main KV + index keys of every KV source, groups that end before ``h``) is
  what the cold prefill of the prefix wrote: exact, since every KV source runs before the CED cut;
* the encoder (layers before the cut) replays ``[h − W, N)`` with every window truncated at ``h − W``,
  regenerating SWA KV only; groups that end at or after ``h`` are written from the replayed rows (§9.4);
* the decoder (layers from the cut on) runs only the last ``W`` prompt rows with windows truncated at
  ``N − W`` (decoder bounded replay, every prefill, §9.3);
* the response is decoded token by token with full windows over those SWA states.

:func:`served_forward` computes all of that in two teacher-forced passes over the whole row, so gradients
flow through every approximation (fake-quant has straight-through gradients):

1. :func:`prefix_global_kv`: the exact forward up to the last KV source gives the prefix's global KV;
2. every layer runs over every row with a per-layer window floor (``h − W`` before the cut, ``N − W`` from
   it on), and each KV source's entries that end before ``h`` are replaced by pass 1's.

Both passes are the model's own stack (:meth:`~dsv41_jax.model.transformer.Transformer.run_layers`) over its
dense store; the floors and the prefix are arguments of it (its ``Schedule``, ``Visibility`` and ``PrefixReuse``).

Rows the engine never computes (before ``h − W``, or before ``N − W`` from the cut on) are computed too, but
nothing live reads them: windows start at the floor, and their global KV is replaced by pass 1's. Rows at
and after the floor, and hence the response logits, are exactly the engine's (``tests/posttrain``).
A row with ``hit = 0`` is a cold prefill (no replay; CED only); with ``cut = None`` and ``hit = 0`` the
forward is the plain training forward.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.model.kv_store import PrefixReuse, Visibility
from dsv41_jax.model.transformer import Schedule, Transformer


class ServePlan(NamedTuple):
    """Per row: where the prefix-cache hit lands (0 = cold prefill) and where the prompt ends."""

    hit: Int[Array, "B"]  # h: global KV of groups ending before h is reused; 0 or window ≤ h ≤ prompt_len
    prompt_len: Int[Array, "B"]  # N: the CED decoder keeps prompt rows [N − W, N); the response follows


class PrefixKV(NamedTuple):
    """Exact global KV of every KV source, in ``kv_source_layers`` order (pass 1)."""

    main_kv: tuple[Float[Array, "B C H"], ...]
    index_k: tuple[Float[Array, "B C I"], ...]


def window_floors(plan: ServePlan, window: int, ced: bool) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
    """(encoder floor, decoder floor): the first position a window may reach before / from the cut on."""
    enc = jnp.where(plan.hit > 0, plan.hit - window, 0).astype(jnp.int32)
    dec = jnp.maximum(enc, plan.prompt_len - window).astype(jnp.int32) if ced else enc
    return enc, dec


def layer_floors(n_layers: int, cut: int | None, enc: Array, dec: Array) -> list[Array]:
    return [enc if cut is None or i < cut else dec for i in range(n_layers)]


def prefix_global_kv(model: Transformer, tokens: Int[Array, "B S"], engram_rows: Array | None,
                     is_image: Bool[Array, "B S"] | None = None) -> PrefixKV:
    """Pass 1: the exact training forward up to the last KV source, keeping every source's global KV."""
    sources = model.cfg.attention.kv_source_layers
    model.check_engram_rows(engram_rows)
    x, pre = model.streams(model.embed_tokens(tokens))
    vis = Visibility(jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    # the last source runs its compressor only; the collected states hold the earlier sources' entries
    _, _, last, _, trace = model.run_layers(x, pre, model.dense_shared(), vis, engram_rows=engram_rows,
                                            is_image=is_image, schedule=Schedule(stop=sources[-1]), collect=True)
    kv = [trace.shared[layer].kv for layer in sources[:-1]] + [last.kv]
    return PrefixKV(tuple(k.main for k in kv), tuple(k.index for k in kv))


def served_forward(model: Transformer, tokens: Int[Array, "B S"], engram_rows: Array | None, plan: ServePlan, *,
                   cut: int | None, prefix: PrefixKV | None = None, is_image: Bool[Array, "B S"] | None = None,
                   indexer_target: str | None = None, remat: str = "none"):
    """fp32 logits of every row as the engine serves them, the routing of every layer, and each layer's
    window floor (rows before it are not computed by the engine: mask them out of routing statistics).
    With ``indexer_target`` (``dense`` | ``topk``) a fourth item: the
    :class:`~dsv41_jax.model.indexer_loss.IndexerStats` of every index
    source (``index_source_layers`` order) over the served path (the layers' windows floored as served).

    ``cut`` is the CED cut layer (``engine.default_ced_cut``; ``None``: no decoder replay). ``prefix`` is
    pass 1's :func:`prefix_global_kv` (computed here when ``None`` and a row has a hit: pass it in to reuse).
    ``remat`` rematerialises each block in the backward pass, as in the training forward.
    """
    cfg = model.cfg
    model.check_engram_rows(engram_rows)
    if prefix is None:
        prefix = prefix_global_kv(model, tokens, engram_rows, is_image)
    w = cfg.attention.window_size
    enc, dec = window_floors(plan, w, cut is not None)
    layers = cfg.attention.kv_source_layers
    reuse = PrefixReuse(dict(zip(layers, prefix.main_kv, strict=True)), dict(zip(layers, prefix.index_k, strict=True)),
                        plan.hit)
    x, pre = model.streams(model.embed_tokens(tokens))
    vis = Visibility(jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), enc)
    x, pre, _, _, trace = model.run_layers(
        x, pre, model.dense_shared(reuse), vis, engram_rows=engram_rows, is_image=is_image,
        schedule=Schedule(truncate=cut, remat=remat, indexer_target=indexer_target), floor=plan.prompt_len - w)
    logits = model.logits(x, pre)
    floors = layer_floors(cfg.n_layers, cut, enc, dec)
    if indexer_target is not None:
        return logits, trace.routing, floors, trace.indexer
    return logits, trace.routing, floors


def draw_hits(key: Array, prompt_len: Int[Array, "B"], window: int, granularity: int, prob: float) -> Int[Array, "B"]:
    """Per row, with probability ``prob``, a hit uniform over the multiples of ``granularity`` in
    ``[window, prompt_len)`` (the last prompt token is always recomputed); otherwise (or when the prompt has no
    such boundary) 0, a cold prefill. Shorter hits are not adopted by the engines (spec §9.4)."""
    k_use, k_pos = jax.random.split(key)
    lo = -(-window // granularity)  # first multiple ≥ window, in units of granularity
    hi = (prompt_len - 1) // granularity  # last multiple < prompt_len
    count = jnp.maximum(hi - lo + 1, 0)
    pick = jnp.floor(jax.random.uniform(k_pos, prompt_len.shape) * count).astype(jnp.int32)
    use = jax.random.bernoulli(k_use, prob, prompt_len.shape) & (count > 0)
    return jnp.where(use, (lo + jnp.minimum(pick, count - 1)) * granularity, 0).astype(jnp.int32)
