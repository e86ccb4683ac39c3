"""Image spans in the token stream: the layout, the placeholder expansion and what each span position takes.

An image becomes ``IMAGE_START, (IMAGE × n_llm_w, IMAGE_NEW_LINE) × n_llm_h, IMAGE_END`` (spec model §7.3):
every position of it carries ``image_token_id`` and only ``token_types`` tells them apart. A prompt names an
image by one ``image_token_id`` (the placeholder); :func:`expand_prompt` replaces each by its image's span.

What enters the backbone at a span position (:func:`span_embeddings`): the learned ``image_start`` /
``image_end`` / ``image_newline`` vectors at the delimiters, the aligner's rows in reading order at the IMAGE
slots. Every span position, delimiters included, routes with ``bias_vl`` and is DEAD for Engram.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


def image_token_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """int64 [n_llm_h·(n_llm_w+1) + 2]: the token types of one image's span."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return np.array([IMAGE_START, *row * n_llm_h, IMAGE_END], np.int64)


class Span(NamedTuple):
    """One image's span in a prompt: its first position, its length and which image fills it."""

    start: int
    length: int
    image: int


class ExpandedPrompt(NamedTuple):
    ids: np.ndarray  # int64 [S]: every span position holds image_token_id
    token_types: np.ndarray  # int64 [S]: TEXT or the span types
    spans: tuple[Span, ...]


def expand_prompt(ids: Sequence[int] | np.ndarray, grids: Sequence[tuple[int, int]], image_token_id: int,
                  images: Sequence[int] | np.ndarray | None = None) -> ExpandedPrompt:
    """Each ``image_token_id`` of ``ids`` replaced by the span of its image's LLM grid ``(n_llm_h, n_llm_w)``.

    The k-th placeholder takes image ``images[k]`` (default: the k-th grid). A count that does not match is an
    error.
    """
    ids = np.asarray(ids, np.int64)
    where = np.flatnonzero(ids == image_token_id)
    order = list(range(len(grids))) if images is None else list(images)
    if len(where) != len(order):
        raise ValueError(f"the prompt has {len(where)} image placeholder(s) (token {image_token_id}) but "
                         f"{len(order)} image(s) were given")
    if any(not 0 <= k < len(grids) for k in order):
        raise ValueError(f"image index out of range: {order} for {len(grids)} image(s)")
    out_ids, out_types, spans, last = [], [], [], 0
    for pos, k in zip(where, order, strict=True):
        out_ids.append(ids[last:pos])
        out_types.append(np.full(pos - last, TEXT, np.int64))
        types = image_token_types(*grids[k])
        spans.append(Span(sum(len(a) for a in out_ids), len(types), k))
        out_ids.append(np.full(len(types), image_token_id, np.int64))
        out_types.append(types)
        last = pos + 1
    out_ids.append(ids[last:])
    out_types.append(np.full(len(ids) - last, TEXT, np.int64))
    return ExpandedPrompt(np.concatenate(out_ids), np.concatenate(out_types), tuple(spans))


def row_index(token_types: np.ndarray, spans_per_row: Sequence[Sequence[Span]], rows_per_image: Sequence[int]
              ) -> np.ndarray:
    """int32 [B, S]: for each IMAGE position, its row in the concatenation of every image's aligner rows
    (images in index order); 0 elsewhere. ``spans_per_row[b]`` lists the spans of sequence ``b``."""
    token_types = np.asarray(token_types)
    first = np.concatenate([[0], np.cumsum(rows_per_image)[:-1]]).astype(np.int64)
    out = np.zeros(token_types.shape, np.int32)
    for b, spans in enumerate(spans_per_row):
        for sp in spans:
            types = token_types[b, sp.start: sp.start + sp.length]
            slots = np.flatnonzero(types == IMAGE)
            if len(slots) != rows_per_image[sp.image]:
                raise ValueError(f"sequence {b}: the span at {sp.start} has {len(slots)} IMAGE slots but image "
                                 f"{sp.image} has {rows_per_image[sp.image]} aligner rows")
            out[b, sp.start + slots] = first[sp.image] + np.arange(len(slots))
    return out


def span_embeddings(token_types: Int[Array, "B S"], rows: Float[Array, "R D"], index: Int[Array, "B S"],
                    start: Float[Array, " D"], end: Float[Array, " D"], newline: Float[Array, " D"]
                    ) -> Float[Array, "B S D"]:
    """What each span position takes (spec model §7.3): delimiters their learned vectors, IMAGE slots the
    aligner row ``rows[index]``; text positions get zeros (the backbone keeps their token embedding)."""
    table = jnp.concatenate([start[None], jnp.zeros_like(start)[None], newline[None], end[None]]).astype(rows.dtype)
    delim = jnp.take(table, jnp.clip(token_types, 0, 3), axis=0)  # [B, S, D]; row 1 (IMAGE) unused
    image = jnp.take(rows, index, axis=0)
    t = token_types[..., None]
    return jnp.where(t == IMAGE, image, jnp.where(t >= 0, delim, jnp.zeros_like(delim)))
