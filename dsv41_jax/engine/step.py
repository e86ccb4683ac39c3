"""A forward over a chunk of new tokens per sequence, through every layer, with the packed cache.

``forward_chunk`` is the one primitive: prefill is a long chunk from position 0, chunked prefill several,
decode a chunk of one, encoder bounded replay a chunk that starts ``window`` tokens before the cache hit
with a window floor and a global-KV write floor. CED narrows the rows after the cut layer to the last
``window`` rows of each sequence, with their windows truncated at the first kept row (spec attention §9).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.engine.attention import StepContext, StepShared, attention_step
from dsv41_jax.model.mhc import collapse
from dsv41_jax.model.transformer import Transformer


class ChunkOptions(NamedTuple):
    """Static switches of a chunk forward."""

    ced_cut: int | None = None  # first layer that runs on the last `window` rows only (None: every row)
    truncate: bool = True  # truncate the narrowed rows' windows at the first kept row (CED semantics)
    # without narrowing, truncate the windows of layers ≥ this one at the last `window` rows (an exact
    # oracle of what CED computes on its kept rows)
    truncate_from: int | None = None
    all_logits: bool = False
    return_selections: bool = False  # also return each index source's top-k selection {layer: [B, S, K]}
    # a CED prefill chunk that is not the last: layers from here on are skipped (their SWA state comes from
    # the last chunk's narrowed rows) and no logits are produced
    skip_from: int | None = None  # logits of every row instead of each sequence's last valid row


def _context(cache: C.Cache, pos: Array, valid: Array, n_new: Array, window: int, replay_start: Array,
             write_floor: Array) -> StepContext:
    last = cache.lengths + n_new - 1
    ring_write = valid & (pos > last[:, None] - window)
    return StepContext(pos, valid, ring_write, C.ring_positions(cache.lengths, window), replay_start, write_floor)


def _narrow(x: Array, n_new: Array, keep: int) -> Array:
    """The last ``keep`` valid rows of each sequence (rows before the first are clipped and marked invalid)."""
    idx = jnp.maximum(n_new[:, None] - keep + jnp.arange(keep)[None], 0)
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1), idx


def _global_kv_only(block, x, pre, ring, sources, ctx, source_ids):
    """Write a KV source's global KV for every row without running the rest of its block."""
    u = block.attn_norm(collapse(x, pre))
    return attention_step(block.attn, u, ring, sources, StepShared(), ctx, source_ids)[2]


def forward_chunk(model: Transformer, cache: C.Cache, tokens: Int[Array, "B S"], engram_rows: Int[Array, "B S L C"],
                  n_new: Int[Array, "B"], *, replay_start: Int[Array, "B"] | None = None,
                  write_floor: Int[Array, "B"] | None = None, is_image: Bool[Array, "B S"] | None = None,
                  options: ChunkOptions | None = None) -> tuple[Float[Array, "B V"], C.Cache]:
    """Run ``tokens[b, :n_new[b]]`` at positions ``cache.lengths[b] + i``; returns logits and the new cache.

    Logits are fp32, of each sequence's last valid row ``[B, V]`` (or of every row ``[B, S', V]`` with
    ``options.all_logits``; under CED only the kept rows exist after the cut).
    """
    cfg = model.cfg
    a = cfg.attention
    options = ChunkOptions() if options is None else options
    b, s = tokens.shape
    w = a.window_size
    zeros = jnp.zeros((b,), jnp.int32)
    replay_start = zeros if replay_start is None else replay_start
    write_floor = zeros if write_floor is None else write_floor
    pos = cache.lengths[:, None] + jnp.arange(s)[None]
    valid = jnp.arange(s)[None] < n_new[:, None]
    h = jnp.take(model.embed.weight[...], tokens, axis=0).astype(cfg.dtype)
    x = jnp.broadcast_to(h[:, :, None, :], (b, s, cfg.mhc.hc_mult, cfg.dim))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, cfg.mhc.hc_mult, dtype=jnp.float32), (b, s, cfg.mhc.hc_mult))
    rings, sources, shared = list(cache.rings), cache.sources, StepShared()
    selections = {}
    ctx = _context(cache, pos, valid, n_new, w, replay_start, write_floor)
    for i, block in enumerate(model.layers):
        if options.skip_from is not None and i >= options.skip_from:
            if block.attn.spec.owns_compressor:  # the paper's cut: its compressor still sees every row
                sources = _global_kv_only(block, x, pre, rings[i], sources, ctx, a.kv_source_layers)
            break
        if options.ced_cut is not None and i == options.ced_cut and s > w:
            if block.attn.spec.owns_compressor:  # the paper's cut: its compressor still sees every row
                sources = _global_kv_only(block, x, pre, rings[i], sources, ctx, a.kv_source_layers)
            x, idx = _narrow(x, n_new, w)
            pre, _ = _narrow(pre, n_new, w)
            is_image = None if is_image is None else _narrow(is_image, n_new, w)[0]
            pos = cache.lengths[:, None] + idx
            valid = (n_new[:, None] - w + jnp.arange(w)[None]) >= 0
            floor = jnp.maximum(replay_start, pos[:, 0]) if options.truncate else replay_start
            ctx = _context(cache, pos, valid, n_new, w, floor, write_floor)
            shared = StepShared(*(None if t is None else _narrow(t, n_new, w)[0] for t in shared))
            if block.attn.spec.owns_compressor:
                ctx = ctx._replace(write_floor=jnp.full((b,), jnp.iinfo(jnp.int32).max))  # written above
        if options.truncate_from is not None and i == options.truncate_from:
            floor = jnp.maximum(replay_start, cache.lengths + n_new - w)
            ctx = ctx._replace(replay_start=floor)
        if block.spec.engram:
            rows = engram_rows[:, :, cfg.engram.layer_ids.index(i)]
            x = block.engram(x, rows, is_image)

        def attend(u, attn=block.attn, ring=rings[i], sources=sources, shared=shared, ctx=ctx):
            y, ring, new_sources, new_shared = attention_step(attn, u, ring, sources, shared, ctx, a.kv_source_layers)
            return y, (ring, new_sources, new_shared)

        x, pre, (rings[i], sources, shared), _ = block.run(x, pre, attend, is_image)
        if block.attn.spec.has_indexer:
            selections[i] = shared.topk
    new_cache = C.Cache(cache.lengths + n_new, tuple(rings), sources)
    if options.skip_from is not None:
        return None, new_cache
    out = model.norm(collapse(x, pre))
    if not options.all_logits:
        last = jnp.maximum(valid.sum(-1) - 1, 0)
        out = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    logits = jnp.einsum("...d,vd->...v", out.astype(jnp.float32), model.head.weight[...].astype(jnp.float32),
                        precision="highest")
    if options.return_selections:
        return logits, new_cache, selections
    return logits, new_cache
