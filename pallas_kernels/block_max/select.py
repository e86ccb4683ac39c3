"""The candidate blocks from block maxima without ``lax.top_k``: a radix search for the k-th largest
maximum, then the blocks above it in index order (spec attention §6.1; ties lower-index-first, as
``lax.top_k``).

``top_k(2048)`` over the block maxima is most of candidate selection on the H200 (BENCHMARKS.md): XLA sorts
each row. The kept set only needs the threshold: blocks strictly above the k-th largest value, then the
lowest-indexed blocks equal to it until k are taken, which is exactly ``lax.top_k``'s set with its tie rule.
Listing them in index order gives the ascending block ids the Reindex layers consume, with no sort.

* Threshold: the k-th largest of order-preserving 32-bit keys is the largest t with #{key >= t} >= k. Eight
  passes of a 16-ary search find it, 4 bits a pass: with the bits above fixed (P), each pass counts
  #{key >= P | j << shift} for j = 1..15 in one fused compare-and-sum over the row and keeps the largest j
  whose count is still >= k. No per-pass rank bookkeeping: the counts are of the whole row. 8-bit digits
  (4 passes of 256 counts) were slower at every shape measured on the H200 (BENCHMARKS.md).
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
# how a pass's 15 counts are laid out for XLA: "siblings" (15 row sums over the same keys, which XLA fuses
# into one multi-output reduction), "bins_major" ([R, 15, N] summed over N) or "bins_minor" ([R, N, 15]
# summed over N); the bench compares them
COUNT_LAYOUTS = ("siblings", "bins_major", "bins_minor")


def order_key(x: Float[Array, "*B N"]) -> Array:
    """f32 -> uint32 with the same order (−0 below +0; NaN is not expected)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _counts_at_least(key: Array, thresholds: Array, layout: str) -> Array:
    """[R, N] keys, [R, J] thresholds -> [R, J] counts #{key >= threshold}."""
    if layout == "siblings":
        return jnp.stack([jnp.sum(key >= thresholds[:, j:j + 1], axis=1, dtype=jnp.int32)
                          for j in range(thresholds.shape[1])], axis=1)
    if layout == "bins_major":
        return jnp.sum(key[:, None, :] >= thresholds[:, :, None], axis=2, dtype=jnp.int32)
    if layout == "bins_minor":
        return jnp.sum(key[:, :, None] >= thresholds[:, None, :], axis=1, dtype=jnp.int32)
    raise ValueError(f"count layout must be one of {COUNT_LAYOUTS}, got {layout!r}")


def kth_largest_key(key: Array, k: int, *, layout: str = "bins_minor") -> Array:
    """Per row of ``key`` [R, N] (1 <= k <= N): the k-th largest key, counted with multiplicity."""
    rows = key.shape[0]
    prefix = jnp.zeros((rows,), jnp.uint32)  # invariant: #{key >= prefix} >= k
    steps = jnp.arange(1, _BINS, dtype=jnp.uint32)
    for shift in range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        thresholds = prefix[:, None] | (steps << shift)  # the bits below shift + 4 of prefix are zero
        counts = _counts_at_least(key, thresholds, layout)  # non-increasing in j
        digit = jnp.sum(counts >= k, axis=1, dtype=jnp.uint32)  # the largest j with count >= k (0: none)
        prefix = prefix | (digit << shift)
    return prefix


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


def select_top_blocks(bmax: Float[Array, "*B NB"], k: int, *, layout: str = "bins_minor") -> Int[Array, "*B K"]:
    """Ascending ids of the top ``min(k, NB)`` blocks (ties to the lower index) whose maximum is > −∞, −1
    padded: equal to sorting ``lax.top_k``'s indices after dropping −∞ values."""
    lead, nb = bmax.shape[:-1], bmax.shape[-1]
    k = min(k, nb)
    flat = bmax.reshape(-1, nb)
    key = order_key(flat)
    threshold = kth_largest_key(key, k, layout=layout)
    above = key > threshold[:, None]
    tie = (key == threshold[:, None]) & (flat > -jnp.inf)  # ties at −∞ are dropped, never kept
    counts = prefix_counts(jnp.stack([above, tie], axis=1))  # [R, 2, NB]
    need = k - counts[:, 0, -1:]  # ties kept: k minus the blocks above (>= 1 unless the ties are at −∞)
    kept_before = counts[:, 0] + jnp.minimum(counts[:, 1], need)  # kept blocks up to and including
    keep = above | (tie & (counts[:, 1] <= need))
    slot = jnp.where(keep, kept_before - 1, k)  # unkept: past the end, dropped
    ids = jnp.full((flat.shape[0], k), -1, jnp.int32)
    ids = jax.vmap(lambda out, s: out.at[s].set(jnp.arange(nb, dtype=jnp.int32), mode="drop"))(ids, slot)
    return ids.reshape(*lead, k)
