"""A forward over a chunk of new tokens per sequence, through every layer, with the packed cache.

``forward_chunk`` is the one primitive: prefill is a long chunk from position 0, chunked prefill several,
decode a chunk of one (:func:`decode_step`), encoder bounded replay a chunk that starts ``window`` tokens
before the cache hit with a window floor and a global-KV write floor. CED narrows the rows after the cut
layer to the last ``window`` rows of each sequence, with their windows truncated at the first kept row
(spec attention §9). The layers are the model's own (:meth:`~dsv41_jax.model.transformer.Transformer.
run_layers`); the cache is their store (:class:`~dsv41_jax.cache.PackedKV`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.model.attention import Shared
from dsv41_jax.model.kv_store import Visibility
from dsv41_jax.model.transformer import Schedule, Transformer


class ChunkOptions(NamedTuple):
    """Static switches of a chunk forward."""

    ced_cut: int | None = None  # first layer that runs on the last `window` rows only (None: every row)
    truncate: bool = True  # truncate the narrowed rows' windows at the first kept row (CED semantics)
    # without narrowing, truncate the windows of layers ≥ this one at the last `window` rows (an exact
    # oracle of what CED computes on its kept rows)
    truncate_from: int | None = None
    all_logits: bool = False  # logits of every row instead of each sequence's last valid row
    return_selections: bool = False  # also return each index source's top-k selection {layer: [B, S, K]}
    # a CED prefill chunk that is not the last: layers from here on are skipped (their SWA state comes from
    # the last chunk's narrowed rows) and no logits are produced
    skip_from: int | None = None
    # also return the DSpark target features of the rows the target layers ran on, with their positions and
    # validity (a :class:`Features`), for the drafter's rings
    main_hidden: bool = False
    # also return each ratio-2 KV source's per-row compressor carry {layer: (c, z) [B, S, H]} (the rollback of
    # a speculative verify chunk, dsv41_jax.engine.speculative)
    row_carries: bool = False


class Features(NamedTuple):
    """DSpark target features of a chunk's rows (under CED: the narrowed rows)."""

    main_hidden: Float[Array, "B S F"]
    pos: Int[Array, "B S"]
    valid: Bool[Array, "B S"]


def forward_chunk(model: Transformer, cache: C.Cache, tokens: Int[Array, "B S"], engram_rows: Int[Array, "B S L G"],
                  n_new: Int[Array, "B"], *, replay_start: Int[Array, "B"] | None = None,
                  write_floor: Int[Array, "B"] | None = None, is_image: Bool[Array, "B S"] | None = None,
                  image_embeds: Float[Array, "B S D"] | None = None, options: ChunkOptions | None = None
                  ) -> tuple:
    """Run ``tokens[b, :n_new[b]]`` at positions ``cache.lengths[b] + i``; returns logits and the new cache.

    Logits are fp32, of each sequence's last valid row ``[B, V]`` (or of every row ``[B, S', V]`` with
    ``options.all_logits``; under CED only the kept rows exist after the cut). ``options.return_selections``,
    ``options.main_hidden`` and ``options.row_carries`` append the selections, the :class:`Features` and the
    per-row carries, in that order. Image-span positions (``is_image``) take ``image_embeds``
    (:meth:`Transformer.embed_tokens`): a span may sit in any chunk.
    """
    cfg = model.cfg
    o = ChunkOptions() if options is None else options
    b, s = tokens.shape
    zeros = jnp.zeros((b,), jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(s)[None]
    vis = Visibility(pos, zeros if replay_start is None else replay_start, valid=jnp.arange(s)[None] < n_new[:, None])
    shared = Shared(C.PackedKV.of(cfg, cache, n_new, write_floor, keep_row_carries=o.row_carries))
    schedule = Schedule(stop=o.skip_from, narrow=o.ced_cut, truncate_narrowed=o.truncate, truncate=o.truncate_from)
    last_window = cache.lengths + n_new - cfg.attention.window_size  # the oracle's floor (truncate_from)
    x, pre = model.streams(model.embed_tokens(tokens, is_image, image_embeds))
    x, pre, shared, vis, trace = model.run_layers(x, pre, shared, vis, engram_rows=engram_rows, is_image=is_image,
                                                  schedule=schedule, floor=last_window,
                                                  collect=o.main_hidden)  # what is not returned is not computed
    new_cache = shared.kv.cache()
    if o.skip_from is not None:
        return None, new_cache
    logits = model.logits(x, pre, None if o.all_logits else jnp.maximum(vis.valid.sum(-1) - 1, 0))
    out = (logits, new_cache)
    if o.return_selections:
        out += (trace.selections,)
    if o.main_hidden:
        out += (Features(jnp.concatenate(trace.targets, axis=-1), vis.pos, vis.valid),)
    if o.row_carries:
        out += (shared.kv.row_carries,)
    return out


def decode_step(model: Transformer, cache: C.Cache, tokens: Int[Array, "B"], engram_rows: Array):
    """One token per sequence through every layer (``engram_rows`` [B, 1, L, C])."""
    b = tokens.shape[0]
    return forward_chunk(model, cache, tokens[:, None], engram_rows, jnp.ones((b,), jnp.int32))
