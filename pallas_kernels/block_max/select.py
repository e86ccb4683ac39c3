"""The candidate blocks from block maxima without ``lax.top_k``: a radix select of the k-th largest maximum,
then the blocks above it in index order (spec attention §6.1; ties lower-index-first, as ``lax.top_k``).

``top_k(2048)`` over the block maxima is most of candidate selection on the H200 (BENCHMARKS.md): XLA sorts
each row. The kept set only needs the threshold: blocks strictly above the k-th largest value, then the
lowest-indexed blocks equal to it until k are taken, which is exactly ``lax.top_k``'s set with its tie rule.
Listing them in index order gives the ascending block ids the Reindex layers consume, with no sort.

* Threshold: 8 passes over the row, one 4-bit digit of an order-preserving 32-bit key each (16 counts per
  row per pass, a fused compare-and-reduce). 8-bit digits (4 passes of 256 counts) were slower at every
  shape measured on the H200 (BENCHMARKS.md).
* Positions in the output: a block's slot is (blocks above the threshold before it) + min(ties before it,
  ties needed). Both prefix counts come from one matmul against a triangular 0/1 matrix per chunk of 256
  (exact: 0/1 inputs in bf16, fp32 sums of at most 256), plus one small matmul over the chunk totals (fp32 at
  HIGHEST precision, exact below 2^24). XLA's ``cumsum`` is an associative scan of ~2 log2(N) kernels on
  GPU; the matmuls are two.

Pure XLA, so it runs on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_DIGIT_BITS = 4
_BINS = 1 << _DIGIT_BITS
_CHUNK = 256


def order_key(x: Float[Array, "*B N"]) -> Array:
    """f32 -> uint32 with the same order (−0 below +0; NaN is not expected)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def kth_largest_key(key: Array, k: int) -> tuple[Array, Array]:
    """Per row of ``key`` [R, N]: the k-th largest key (with multiplicity) and how many of the keys equal to
    it belong to the top k (1 ≤ need ≤ its count)."""
    rows = key.shape[0]
    prefix = jnp.zeros((rows,), jnp.uint32)
    rank = jnp.full((rows,), k, jnp.int32)  # rank of the wanted key among those matching the prefix
    digits = jnp.arange(_BINS, dtype=jnp.uint32)
    for shift in range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        hi = shift + _DIGIT_BITS
        match = (key >> hi) == (prefix >> hi)[:, None] if hi < 32 else jnp.ones(key.shape, bool)
        digit = (key >> shift) & jnp.uint32(_BINS - 1)
        # at_least[r, j] = #{matching keys with digit >= j}
        at_least = jnp.sum(match[..., None] & (digit[..., None] >= digits), axis=1, dtype=jnp.int32)
        chosen = jnp.sum(at_least >= rank[:, None], axis=1) - 1  # the largest j with at_least[j] >= rank
        above = jnp.take_along_axis(jnp.pad(at_least, ((0, 0), (0, 1))), chosen[:, None] + 1, axis=1)[:, 0]
        rank = rank - above
        prefix = prefix | (chosen.astype(jnp.uint32) << shift)
    return prefix, rank


def prefix_counts(flags: Bool[Array, "R C N"]) -> Int[Array, "R C N"]:
    """Inclusive prefix sums along the last axis of 0/1 flags, by two exact matmuls (see the module doc)."""
    r, c, n = flags.shape
    m = -(-n // _CHUNK)
    x = jnp.pad(flags, ((0, 0), (0, 0), (0, m * _CHUNK - n))).astype(jnp.bfloat16).reshape(r, c, m, _CHUNK)
    i = jnp.arange(_CHUNK)
    upper = (i[:, None] <= i[None, :]).astype(jnp.bfloat16)  # out[j] = Σ_{i ≤ j} x[i]
    within = jnp.einsum("rcmi,ij->rcmj", x, upper, preferred_element_type=jnp.float32)
    j = jnp.arange(m)
    before = (j[:, None] < j[None, :]).astype(jnp.float32)  # chunk offsets: Σ of earlier chunks' totals
    offsets = jnp.einsum("rcm,mn->rcn", within[..., -1], before, precision=jax.lax.Precision.HIGHEST)
    out = (within + offsets[..., None]).reshape(r, c, m * _CHUNK)[..., :n]
    return jnp.round(out).astype(jnp.int32)


def select_top_blocks(bmax: Float[Array, "*B NB"], k: int) -> Int[Array, "*B K"]:
    """Ascending ids of the top ``min(k, NB)`` blocks (ties to the lower index) whose maximum is > −∞, −1
    padded: equal to sorting ``lax.top_k``'s indices after dropping −∞ values."""
    lead, nb = bmax.shape[:-1], bmax.shape[-1]
    k = min(k, nb)
    flat = bmax.reshape(-1, nb)
    key = order_key(flat)
    threshold, need = kth_largest_key(key, k)
    above = key > threshold[:, None]
    tie = (key == threshold[:, None]) & (flat > -jnp.inf)  # ties at −∞ are dropped, never kept
    counts = prefix_counts(jnp.stack([above, tie], axis=1))  # [R, 2, NB]
    kept_before = counts[:, 0] + jnp.minimum(counts[:, 1], need[:, None])  # kept blocks up to and including
    keep = above | (tie & (counts[:, 1] <= need[:, None]))
    slot = jnp.where(keep, kept_before - 1, k)  # unkept: past the end, dropped
    ids = jnp.full((flat.shape[0], k), -1, jnp.int32)
    ids = jax.vmap(lambda out, s: out.at[s].set(jnp.arange(nb, dtype=jnp.int32), mode="drop"))(ids, slot)
    return ids.reshape(*lead, k)
