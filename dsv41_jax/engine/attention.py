"""One attention layer over a chunk of new tokens, reading and writing the packed caches (spec attention §8).

The chunk's rows sit at absolute positions ``start + i``; the same code serves prefill (long chunks), chunked
prefill, decode (one row) and bounded replay (a window floor and a global-KV write floor).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from dsv41_jax import cache as C
from dsv41_jax.model.attention import Attention
from dsv41_jax.model.indexer import candidate_block_ids, gathered_index_scores, index_scores, select_topk
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.model.sparse import sparse_attention


class StepShared(NamedTuple):
    """Selections that flow from index sources to the layers after them, within one step."""

    topk: Int[Array, "B S K"] | None = None  # absolute entry indices, ascending, −1 = empty
    candidates: Int[Array, "B S NB"] | None = None  # kept block ids of the candidate source, ascending, −1


class StepContext(NamedTuple):
    pos: Int[Array, "B S"]  # absolute position of every row
    valid: Bool[Array, "B S"]  # rows that are real tokens (ragged chunks pad the rest)
    ring_write: Bool[Array, "B S"]  # rows whose SWA KV goes to the ring (the last W valid rows)
    ring_pos: Int[Array, "B W"]  # positions held by the ring slots before this chunk
    replay_start: Int[Array, "B"]  # window floor: keys before it are invisible (bounded replay)
    write_floor: Int[Array, "B"]  # global KV entries whose group ends before it are not rewritten


def attention_step(attn: Attention, x: jax.Array, ring: C.RingCache, sources: tuple[C.SourceCache, ...],
                   shared: StepShared, ctx: StepContext, source_ids: tuple[int, ...]):
    """Returns ``(y, ring, sources, shared)`` for one layer."""
    spec, cfg = attn.spec, attn.cfg
    q, q_latent = attn.query(x, ctx.pos)
    window_kv = attn.window_kv(x, ctx.pos)
    picked = topk = None
    if spec.compressed:
        si = source_ids.index(spec.kv_source)
        if spec.owns_compressor:
            sources = sources[:si] + (_compress(attn, sources[si], x, ctx),) + sources[si + 1:]
        if spec.has_indexer:
            shared = _select(attn, sources[si], x, q_latent, ctx, shared)
        topk = shared.topk
        picked = C.read_main_kv(sources[si], topk, q.dtype, backend=cfg.kernel_backend)
    o = sparse_attention(q, window_kv, attn.attn_sink[...], cfg.window_size, topk=topk, picked=picked,
                         replay_start=ctx.replay_start, start=ctx.pos[:, 0], prefix_kv=C.read_ring(ring, q.dtype),
                         prefix_pos=ctx.ring_pos)
    ring = C.write_ring(ring, window_kv, ctx.pos, ctx.ring_write)
    return attn.output(o, ctx.pos), ring, sources, shared


def _compress(attn: Attention, src: C.SourceCache, x: jax.Array, ctx: StepContext) -> C.SourceCache:
    """Close the groups that complete in this chunk and write their main KV and index keys (spec §3.3, §3.4)."""
    m = attn.spec.ratio
    comp = attn.compressor
    if m == 1:
        latent = comp(x)  # [B, S, H]: one entry per token
        closes = ctx.valid
    else:
        c, z = comp.project(x)  # fp32 [B, S, H]
        prev_c = jnp.concatenate([src.carry_c[:, None], c[:, :-1]], axis=1)
        prev_z = jnp.concatenate([src.carry_z[:, None], z[:, :-1]], axis=1)
        latent = comp.pool(jnp.stack([prev_c, c], axis=2), jnp.stack([prev_z, z], axis=2), x.dtype)
        closes = ctx.valid & (ctx.pos % m == m - 1)
        last = jnp.maximum(ctx.valid.sum(-1) - 1, 0)[:, None, None]
        keep = ctx.valid.any(-1)[:, None]  # the open group's first token becomes the carry
        src = src._replace(carry_c=jnp.where(keep, jnp.take_along_axis(c, last, 1)[:, 0], src.carry_c),
                           carry_z=jnp.where(keep, jnp.take_along_axis(z, last, 1)[:, 0], src.carry_z))
    entry = ctx.pos // m
    cpos = entry * m
    index_k = attn.indexer.keys(latent, cpos, attn.freqs)
    main_kv = apply_rope(latent, cpos, attn.freqs, heads=False)
    # bounded replay never rewrites global KV; a group that ends at or after the floor is still written
    write = closes & (ctx.pos >= ctx.write_floor[:, None])
    return C.write_source(src, main_kv, index_k, jnp.where(write, entry, src.kv_codes.shape[1]),
                          backend=attn.cfg.kernel_backend)


def _select(attn: Attention, src: C.SourceCache, x: jax.Array, q_latent: jax.Array, ctx: StepContext,
            shared: StepShared) -> StepShared:
    cfg, spec = attn.cfg, attn.spec
    n_visible = (ctx.pos + 1) // spec.ratio
    iq, w = attn.indexer.queries(x, q_latent, ctx.pos, attn.freqs)
    if spec.uses_candidates:
        return shared._replace(topk=_select_in_candidates(attn, src, iq, w, n_visible, shared.candidates))
    keys = C.read_index_keys(src, iq.dtype, backend=cfg.kernel_backend)  # the full visible range
    scores = index_scores(iq, w, keys)
    scores = jnp.where(jnp.arange(keys.shape[1]) < n_visible[..., None], scores, -jnp.inf)
    if spec.candidate_source:
        shared = shared._replace(candidates=candidate_block_ids(
            scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks, backend=cfg.kernel_backend))
    return shared._replace(topk=select_topk(scores, cfg.index_topk, n_visible))


def _select_in_candidates(attn: Attention, src: C.SourceCache, iq, w, n_visible, blocks) -> jax.Array:
    """Reindex layers score only the candidate pool's positions, so their cost does not grow with context.

    Kept blocks are ascending, so candidate slot order is position order and ``lax.top_k`` breaks ties
    towards the lower position exactly as the full masked scan does.
    """
    cfg = attn.cfg
    bs = cfg.candidate_block_size
    idx = (blocks[..., None] * bs + jnp.arange(bs)).reshape(*blocks.shape[:2], -1)  # [B, S, NB·bs]
    ok = jnp.repeat(blocks >= 0, bs, axis=-1) & (idx < n_visible[..., None])
    keys = C.read_index_keys_at(src, jnp.where(ok, idx, 0), iq.dtype, backend=cfg.kernel_backend)
    scores = jnp.where(ok, gathered_index_scores(iq, w, keys), -jnp.inf)
    _, j = jax.lax.top_k(scores, min(cfg.index_topk, scores.shape[-1]))
    sel = jnp.take_along_axis(jnp.where(ok, idx, -1), j, axis=-1)
    sel = jnp.sort(jnp.where(sel >= 0, sel, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.where(sel < n_visible[..., None], sel, -1).astype(jnp.int32)
