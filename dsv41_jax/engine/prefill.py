"""Prefill (exact / CED) and encoder bounded replay after a prefix-cache hit (spec §8, §9).

All entry points take the model, a packed :class:`~dsv41_jax.cache.Cache` and host-computed Engram rows,
and return fp32 logits of each sequence's last token with the updated cache.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from dsv41_jax import cache as C
from dsv41_jax.config import ModelConfig
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.model.transformer import Transformer


def default_ced_cut(cfg: ModelConfig) -> int:
    """The engines' cut: the layer after the candidate source (it keeps its window exact; spec §9.3)."""
    return cfg.attention.candidate_source_layer + 1


def check_ced_cut(cfg: ModelConfig, cut: int) -> None:
    """A legal cut: every KV source before it (the paper's cut is the candidate source itself) and no Engram
    layer at or after it, so the narrowed layers own nothing but SWA KV (spec §9.3)."""
    c = cfg.attention.candidate_source_layer
    if cut not in (c, c + 1):
        raise ValueError(f"ced cut layer {cut} must be the candidate source {c} (paper) or {c + 1} (engines)")
    if any(e >= cut for e in cfg.engram.layer_ids):
        raise ValueError(f"ced cut layer {cut}: Engram layers {cfg.engram.layer_ids} must all come before it")


def prefill(model: Transformer, cache: C.Cache, tokens: Int[Array, "B S"], engram_rows: Array, n_new: Array, *,
            mode: Literal["exact", "ced"] = "exact", cut: int | None = None, is_image=None, image_embeds=None):
    """Prefill ``tokens[b, :n_new[b]]`` after what the cache holds (one chunk of a chunked prefill).

    ``exact`` runs every layer over every token (the reference). ``ced`` runs layers before ``cut`` over
    every token and the rest over each sequence's last ``window`` tokens with truncated windows; their SWA
    rings then hold exactly what decoding needs. Image-span positions (``is_image``) take ``image_embeds``.
    """
    _check_capacity(model.cfg, cache, n_new)
    options = ChunkOptions()
    if mode == "ced":
        cut = default_ced_cut(model.cfg) if cut is None else cut
        check_ced_cut(model.cfg, cut)
        options = ChunkOptions(ced_cut=cut)
    elif mode != "exact":
        raise ValueError(f"prefill mode must be 'exact' or 'ced', got {mode!r}")
    return forward_chunk(model, cache, tokens, engram_rows, n_new, is_image=is_image, image_embeds=image_embeds,
                         options=options)


def replay_after_hit(model: Transformer, cache: C.Cache, tokens: Int[Array, "B S"], engram_rows: Array,
                     hit: Int[Array, "B"], n_new: Int[Array, "B"], *, options: ChunkOptions | None = None):
    """Encoder bounded replay (spec §9.4) for sequences whose cache holds global KV for ``[0, hit)`` only.

    ``tokens[b]`` starts at position ``hit[b] − window``: the prefix's last ``window`` tokens are replayed
    with windows truncated at that start, regenerating SWA KV only (global KV before ``hit`` is never
    rewritten; a ratio-2 group straddling ``hit`` is completed), then ``n_new[b] − window`` suffix tokens
    follow. Hits shorter than the window are not adopted: recompute from position 0 instead.
    """
    w = model.cfg.attention.window_size
    start = hit - w
    if not isinstance(start, jax.core.Tracer) and bool(jnp.any(start < 0)):  # traced: the caller checked
        raise ValueError(f"cache hits shorter than the window ({w}) must be recomputed from position 0: {hit}")
    resumed = cache._replace(lengths=start.astype(jnp.int32))
    _check_capacity(model.cfg, resumed, n_new)
    return forward_chunk(model, resumed, tokens, engram_rows, n_new, replay_start=start, write_floor=hit,
                         options=options)


def max_seq_len(cfg: ModelConfig, cache: C.Cache) -> int:
    a = cfg.attention
    return min(src.kv_codes.shape[1] * a.compress_ratios[layer]
               for layer, src in zip(a.kv_source_layers, cache.sources, strict=True))


def _check_capacity(cfg: ModelConfig, cache: C.Cache, n_new: Array) -> None:
    """A clear error for a prompt that does not fit (skipped when traced: the caller knows the lengths)."""
    if isinstance(cache.lengths, jax.core.Tracer) or isinstance(n_new, jax.core.Tracer) or not cache.sources:
        return
    limit = max_seq_len(cfg, cache)
    end = np.asarray(cache.lengths) + np.asarray(n_new)
    if (end > limit).any():
        raise ValueError(f"sequence(s) {np.flatnonzero(end > limit).tolist()} need {end.max()} positions but the "
                         f"cache holds max_seq_len = {limit}")
    if (np.asarray(n_new) < 0).any():
        raise ValueError(f"n_new must be ≥ 0, got {np.asarray(n_new)}")
