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

from dsv41_jax.model.attention import PrefixReuse, Shared
from dsv41_jax.model.documents import entries
from dsv41_jax.model.mhc import collapse
from dsv41_jax.model.transformer import Transformer


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


def _start(model: Transformer, tokens: Int[Array, "B S"]):
    cfg = model.cfg
    b, s = tokens.shape
    h = jnp.take(model.embed.weight[...], tokens, axis=0).astype(cfg.dtype)
    x = jnp.broadcast_to(h[:, :, None, :], (b, s, cfg.mhc.hc_mult, cfg.dim))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, cfg.mhc.hc_mult, dtype=jnp.float32), (b, s, cfg.mhc.hc_mult))
    return x, pre


def _engram(model: Transformer, i: int, x, engram_rows, is_image):
    block = model.layers[i]
    if not block.spec.engram:
        return x
    return block.engram(x, engram_rows[:, :, model.cfg.engram.layer_ids.index(i)], is_image)


def prefix_global_kv(model: Transformer, tokens: Int[Array, "B S"], engram_rows: Array | None,
                     is_image: Bool[Array, "B S"] | None = None) -> PrefixKV:
    """Pass 1: the exact training forward up to the last KV source, keeping every source's global KV."""
    last = max(model.cfg.attention.kv_source_layers)
    x, pre = _start(model, tokens)
    shared, main, index = Shared(), [], []
    for i, block in enumerate(model.layers[: last + 1]):
        x = _engram(model, i, x, engram_rows, is_image)
        if i == last:  # only its compressor is needed
            u = block.attn_norm(collapse(x, pre))
            ent = entries(None, block.spec.ratio, u.shape[0], u.shape[1])
            shared = block.attn._publish_kv(u, shared, ent)
        else:
            x, pre, shared, _ = block(x, pre, shared, is_image)
        if block.spec.owns_compressor:
            main.append(shared.main_kv)
            index.append(shared.index_k)
    return PrefixKV(tuple(main), tuple(index))


def served_forward(model: Transformer, tokens: Int[Array, "B S"], engram_rows: Array | None, plan: ServePlan, *,
                   cut: int | None, prefix: PrefixKV | None = None, is_image: Bool[Array, "B S"] | None = None,
                   indexer_target: str | None = None):
    """fp32 logits of every row as the engine serves them, the routing of every layer, and each layer's
    window floor (rows before it are not computed by the engine: mask them out of routing statistics).
    With ``indexer_target`` (``dense`` | ``topk``) a fourth item: the
    :class:`~dsv41_jax.model.indexer_loss.IndexerStats` of every index
    source (``index_source_layers`` order) over the served path (``Attention.__call__`` with a replay floor).

    ``cut`` is the CED cut layer (``engine.default_ced_cut``; ``None``: no decoder replay). ``prefix`` is
    pass 1's :func:`prefix_global_kv` (computed here when ``None`` and a row has a hit: pass it in to reuse).
    """
    cfg = model.cfg
    if cfg.engram.layer_ids and engram_rows is None:
        raise ValueError("this config has Engram layers: pass engram_rows [B, S, n_engram_layers, columns]")
    if prefix is None:
        prefix = prefix_global_kv(model, tokens, engram_rows, is_image)
    enc, dec = window_floors(plan, cfg.attention.window_size, cut is not None)
    floors = layer_floors(cfg.n_layers, cut, enc, dec)
    sources = {layer: (m, k) for layer, m, k in zip(cfg.attention.kv_source_layers, prefix.main_kv,
                                                      prefix.index_k, strict=True)}
    x, pre = _start(model, tokens)
    shared, routing, stats = Shared(), [], []
    for i, block in enumerate(model.layers):
        x = _engram(model, i, x, engram_rows, is_image)
        kv = sources.get(i)

        def attend(u, attn=block.attn, shared=shared, floor=floors[i], kv=kv):
            reuse = None if kv is None else PrefixReuse(*kv, plan.hit)
            return attn(u, shared, indexer_target=indexer_target, replay_floor=floor, reuse=reuse)

        x, pre, shared, r = block.run(x, pre, attend, is_image)
        routing.append(r)
        if shared.indexer is not None:
            stats.append(shared.indexer)
            shared = shared._replace(indexer=None)
    out = model.norm(collapse(x, pre))
    logits = jnp.einsum("bsd,vd->bsv", out.astype(jnp.float32), model.head.weight[...].astype(jnp.float32),
                        precision="highest")
    if indexer_target is not None:
        return logits, tuple(routing), floors, tuple(stats)
    return logits, tuple(routing), floors


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
