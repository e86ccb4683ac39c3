"""Document (sample-level) masking of packed training rows (spec attention §7.6, [TR §4.2.2]).

A packed row holds several documents: ``segment_ids`` number them (contiguous runs; 0 = padding, which is
one more run) and ``positions`` restart at 0 in each. With documents, nothing flows between the documents of
a row, and each document is computed exactly as if it were alone in a row of its own (up to fp rounding,
at any offset in the row):

- RoPE uses the per-document positions;
- the SWA window of a query starts no earlier than its document's first token;
- compressed groups are formed **per document**: group j of a document holds its tokens ``jm … jm+m−1``
  (document positions), so a group never straddles a boundary, and entry j is positioned at ``jm`` (§3.4).
  The entries of a row are stored in row order, documents one after another, so each query sees a
  contiguous range ``lo ≤ t < hi`` of them: ``lo`` = the first entry of its document, ``hi`` = one past the
  newest entry of its document whose group is complete (§3.5's ``(p+1) div m``, counted in the document).
  A document's trailing partial group yields no entry, as at the end of a sequence;
- indexer scores outside ``[lo, hi)`` are −∞ before top-k and candidate pooling, and picks outside the range
  become −1; candidate blocks (§6) are counted from ``lo``, so blocks of other documents are never pinned
  or kept and a document's blocks are those it would have alone;
- Engram rows come from the data pipeline, hashed per document with a fresh history (spec model §6.5):
  no n-gram reaches into a previous document. (A document split over rows keeps its own earlier tokens
  in the n-grams of its continuation piece: the same document, never another one.)

Without documents every function here reproduces today's single-document layout (``lo = 0``,
``hi = (p+1) div m``, group j at rows ``jm … jm+m−1``) and the model takes its original code path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


class Documents(NamedTuple):
    """Per-token document facts of a packed batch, in row coordinates."""

    positions: Int[Array, "B S"]  # RoPE position of each token inside its document
    start: Int[Array, "B S"]  # row index of the first token of each token's document


class Entries(NamedTuple):
    """Where the compressed entries of ratio ``m`` come from and which of them each query may see."""

    first: Int[Array, "B C"] | None  # row of each entry's first token (None: entry j starts at row j·m)
    positions: Int[Array, "B C"]  # RoPE position of each entry: its group's first token (§3.4)
    lo: Int[Array, "B S"] | None  # first entry of the query's document (None: 0)
    hi: Int[Array, "B S"]  # one past the newest entry visible to the query


def documents(segment_ids: Int[Array, "B S"], positions: Int[Array, "B S"] | None = None) -> Documents:
    """Document starts from ``segment_ids``; ``positions`` default to the offset from the document start.

    Documents must be contiguous runs of one id (the pipeline's packing guarantees it); a change of id
    starts a new document. Given positions are used for RoPE only, so they should restart at 0 in each run.
    """
    seg = jnp.asarray(segment_ids)
    if seg.ndim != 2:
        raise ValueError(f"segment_ids must be [B, S], got shape {seg.shape}")
    if positions is not None and jnp.shape(positions) != seg.shape:
        raise ValueError(f"positions {jnp.shape(positions)} must have the shape of segment_ids {seg.shape}")
    b, s = seg.shape
    rows = jnp.arange(s, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(first, rows, 0), axis=1)
    pos = rows - start if positions is None else jnp.asarray(positions, jnp.int32)
    return Documents(pos, start)


def entries(docs: Documents | None, ratio: int, batch: int, length: int) -> Entries:
    """The compressed-entry layout of ratio ``ratio`` over rows of ``length`` tokens (module docstring)."""
    m, c = ratio, length // ratio
    rows = jnp.arange(length, dtype=jnp.int32)
    if docs is None:
        hi = jnp.broadcast_to((rows + 1) // m, (batch, length))
        return Entries(None, jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32) * m, (batch, c)), None, hi)
    closes = (rows - docs.start + 1) % m == 0  # the token completes a group of its document
    hi = jnp.cumsum(closes, axis=1, dtype=jnp.int32)  # entries complete at or before each token
    lo = jnp.take_along_axis(hi - closes, docs.start, axis=1)  # entries of earlier documents
    ids = jnp.where(closes, hi - 1, c)  # the entry each closing token completes (c: none, dropped)
    first = jax.vmap(lambda i, v: jnp.zeros((c,), jnp.int32).at[i].set(v, mode="drop"))(
        ids, jnp.broadcast_to(rows - (m - 1), ids.shape))
    return Entries(first, jnp.take_along_axis(docs.positions, first, axis=1), lo, hi)


def visible(e: Entries, n_entries: int) -> jax.Array:
    """bool [B, S, T]: entry t is visible to the query (``lo ≤ t < hi``)."""
    t = jnp.arange(n_entries)
    vis = t < e.hi[..., None]
    return vis if e.lo is None else vis & (t >= e.lo[..., None])


def to_document(x: jax.Array, lo: Int[Array, "B S"], fill) -> jax.Array:
    """``out[..., u] = x[..., lo + u]`` (``fill`` past the end): entry axis counted from the document start."""
    t = x.shape[-1]
    idx = lo[..., None] + jnp.arange(t)
    return jnp.where(idx < t, jnp.take_along_axis(x, jnp.minimum(idx, t - 1), axis=-1), fill)


def from_document(x: jax.Array, lo: Int[Array, "B S"], fill) -> jax.Array:
    """Inverse of :func:`to_document`: ``out[..., t] = x[..., t − lo]`` (``fill`` before ``lo``)."""
    t = x.shape[-1]
    idx = jnp.arange(t) - lo[..., None]
    return jnp.where(idx >= 0, jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=-1), fill)
