"""The candidate blocks from block maxima without ``lax.top_k``: a radix search for the k-th largest
maximum, then the blocks above it in index order (spec attention §6.1; ties lower-index-first, as
``lax.top_k``).

``top_k(2048)`` over the block maxima is most of candidate selection on the H200 (BENCHMARKS.md): XLA sorts
each row. The kept set only needs the threshold: blocks strictly above the k-th largest value, then the
lowest-indexed blocks equal to it until k are taken, which is exactly ``lax.top_k``'s set with its tie rule.
Listing them in index order gives the ascending block ids the Reindex layers consume, with no sort.

* Threshold: the k-th largest of order-preserving 32-bit keys is the largest t with #{key >= t} >= k. Eight
  passes of a 16-ary search find it, 4 bits a pass: with the bits above fixed (P), each pass counts
  #{key >= P | j << shift} for j = 1..15 and keeps the largest j whose count is still >= k. No per-pass rank
  bookkeeping: the counts are of the whole row. On the H200 a pass is three XLA kernels: a variadic
  reduction (15 operands, each key read once, 15 accumulators per thread) over chunks of ``_COUNT_CHUNK``
  keys, the sum over the chunks with the digit, and the prefix update (``radix_mosaic`` does a pass in one
  Mosaic GPU kernel). 8-bit digits (4 passes of 256 counts) and other layouts of the counts were slower on the H200
  (BENCHMARKS.md).
* Positions in the output: a block's slot is (blocks above the threshold before it) + min(ties before it,
  ties needed). Both prefix counts come from one matmul against a triangular 0/1 matrix per chunk of 256
  (exact: the disjoint flags coded as 0 / 1 / 512 in bf16, fp32 sums below 2^17), plus one small matmul over
  the chunk totals (each <= 256, so exact in bf16; fp32 sums exact below 2^24). XLA's ``cumsum`` is an
  associative scan of ~2 log2(N) kernels on GPU; the matmuls are two.

Pure XLA, so it runs on every backend; ``kernel`` swaps the threshold search for a Mosaic GPU one
(``radix_mosaic``: a kernel a pass; ``radix_cluster``: one kernel, a cluster of CTAs a row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.block_max import radix_cluster, radix_mosaic

_DIGIT_BITS = 4
_BINS = 1 << _DIGIT_BITS
_CHUNK = 256  # blocks per triangular matmul
_COUNT_CHUNK = 4096  # keys per first-stage count: the fastest of 256-8192 at all three bench shapes on the H200


def order_key(x: Float[Array, "*B N"]) -> Array:
    """f32 -> uint32 with the same order (−0 below +0; NaN is not expected)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _sum(a, b):
    return tuple(x + y for x, y in zip(a, b, strict=True))


def digit_from_counts(counts: Int[Array, "R 15"], k) -> Array:
    """The digit of a pass from its counts #{key >= prefix | j << shift}, j = 1..15 (falling with j): the
    largest j whose count is still >= k (0: none)."""
    return jnp.sum(counts >= k, axis=1, dtype=jnp.uint32)


def _search_digit(key: Array, prefix: Array, shift: int, k: int) -> Array:
    """One 4-bit digit of the k-th largest key (the bits of prefix below shift + 4 are zero)."""
    r, n = key.shape
    c = -(-n // _COUNT_CHUNK)
    chunks = jnp.pad(key, ((0, 0), (0, c * _COUNT_CHUNK - n))).reshape(r, c, _COUNT_CHUNK)  # 0 pads: t >= 1
    hits = tuple((chunks >= (prefix | jnp.uint32(j << shift))[:, None, None]).astype(jnp.int32)
                 for j in range(1, _BINS))
    partial = jax.lax.reduce(hits, (jnp.int32(0),) * len(hits), _sum, (2,))  # 15 x [R, C]
    return digit_from_counts(jnp.sum(jnp.stack(partial, axis=2), axis=1), k)


def kth_largest_key(key: Array, k: int) -> Array:
    """Per row of ``key`` [R, N] (1 <= k <= N): the k-th largest key, counted with multiplicity."""
    prefix = jnp.zeros((key.shape[0],), jnp.uint32)  # invariant: #{key >= prefix} >= k
    for shift in range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        prefix = prefix | (_search_digit(key, prefix, shift, k) << shift)
    return prefix


def _triangle(n: int, strict: bool) -> np.ndarray:
    """[n, n] 0/1 in bf16: ``out[j] = Σ_{i <= j} x[i]`` (``i < j`` when strict) as ``x @ triangle``."""
    i = np.arange(n)
    return ((i[:, None] < i[None, :]) if strict else (i[:, None] <= i[None, :])).astype(jnp.bfloat16)


def disjoint_prefix_counts(a: Bool[Array, "R N"], b: Bool[Array, "R N"]) -> tuple[Array, Array]:
    """Inclusive prefix sums (exact integers in fp32, [R, M * 256] with M = ceil(N / 256), zero-padded
    flags past N) of two disjoint 0/1 flag rows with one matmul: the chunk-local sums of ``a + 512 b``
    (values 0, 1, 512: exact in bf16) are ``sa + 512 sb`` with sa, sb <= 256, exact in fp32 and split by a
    power-of-two divide. The chunk offsets are one more matmul over the chunk totals (<= 256: exact in
    bf16; fp32 sums exact below 2^24)."""
    r, n = a.shape
    m = -(-n // _CHUNK)
    code = a.astype(jnp.bfloat16) + b.astype(jnp.bfloat16) * 512
    x = jnp.pad(code, ((0, 0), (0, m * _CHUNK - n))).reshape(r, m, _CHUNK)
    within = jnp.einsum("rmi,ij->rmj", x, _triangle(_CHUNK, False), preferred_element_type=jnp.float32)
    wb = jnp.floor(within * (1 / 512))
    wa = within - 512 * wb
    totals = jnp.stack([wa[..., -1], wb[..., -1]], axis=1).astype(jnp.bfloat16)  # [R, 2, M]
    offsets = jnp.einsum("rcm,mn->rcn", totals, _triangle(m, True), preferred_element_type=jnp.float32)
    return ((wa + offsets[:, 0, :, None]).reshape(r, m * _CHUNK),
            (wb + offsets[:, 1, :, None]).reshape(r, m * _CHUNK))


KERNELS = (None, "passes", "cluster", "auto")


def pick_kernel(r: int, n: int) -> str:
    """``"auto"``'s choice for R rows of N keys: the per-pass kernels where each of their CTAs counts one
    tile (their fast case: 4.5 µs a pass at 8 x 131072 on the H200), else the one-kernel cluster search,
    else (rows past one cluster) the per-pass kernels."""
    geo = radix_mosaic.geometry(r, n)
    if geo is not None and geo[1] == 1:
        return "passes"
    return "cluster" if radix_cluster.supports(n) else "passes"


def kth_largest(flat: Float[Array, "R N"], key: Array, k: int, kernel: str | None = None) -> Array:
    """The k-th largest order key of each row (uint32 [R]): XLA passes (``kernel=None``), one Mosaic GPU
    kernel a pass (``"passes"``, ``radix_mosaic``), the whole search in one kernel with a cluster of CTAs a
    row (``"cluster"``, ``radix_cluster``), or the faster of the two for the shape (``"auto"``,
    :func:`pick_kernel`). Rows too long for one cluster take ``"passes"``, rows too long for those (past
    4.2 M keys) the XLA passes. The kernels are interpreted off GPU."""
    if kernel not in KERNELS:
        raise ValueError(f"kth_largest: kernel must be one of {KERNELS}, got {kernel!r}")
    interpret = jax.default_backend() != "gpu"
    if kernel == "auto":
        kernel = pick_kernel(*flat.shape)
    if kernel == "cluster" and radix_cluster.supports(flat.shape[-1], interpret):
        return radix_cluster.kth_largest_key(flat, k, ctas=radix_cluster.max_ctas(interpret), interpret=interpret)
    if kernel is not None and radix_mosaic.supports(flat.shape[-1]):
        return radix_mosaic.kth_largest_key(flat, k, interpret=interpret)
    return kth_largest_key(key, k)


def select_top_blocks(bmax: Float[Array, "*B NB"], k: int, *, kernel: str | None = None) -> Int[Array, "*B K"]:
    """Ascending ids of the top ``min(k, NB)`` blocks (ties to the lower index) whose maximum is > −∞, −1
    padded: equal to sorting ``lax.top_k``'s indices after dropping −∞ values. ``kernel`` picks how the
    threshold is found (:func:`kth_largest`)."""
    lead, nb = bmax.shape[:-1], bmax.shape[-1]
    k = min(k, nb)
    flat = bmax.reshape(-1, nb)
    if kernel is not None:  # the kernels read the maxima themselves; the flags below fuse the key
        key = order_key(flat)
    else:
        # materialised once: fused into each pass's count, the key's computation ran in every pass (and
        # with the Mosaic block max feeding it, XLA's count fusions were 2.4x slower on the H200)
        key = jax.lax.optimization_barrier(order_key(flat))
    threshold = kth_largest(flat, key, k, kernel)[:, None]
    above = key > threshold
    tie = (key == threshold) & (flat > -jnp.inf)  # ties at −∞ are dropped, never kept
    n_above, n_tie = disjoint_prefix_counts(above, tie)  # [R, NBp], NBp = NB rounded up to 256
    pad = ((0, 0), (0, n_above.shape[1] - nb))
    above, tie = jnp.pad(above, pad), jnp.pad(tie, pad)
    need = k - n_above[:, -1:]  # ties kept: k minus the blocks above (>= 1 unless the ties are at −∞)
    keep = above | (tie & (n_tie <= need))
    slot = jnp.where(keep, n_above + jnp.minimum(n_tie, need) - 1, k).astype(jnp.int32)  # unkept: dropped
    ids = jnp.full((flat.shape[0], k), -1, jnp.int32)
    blocks = jnp.arange(slot.shape[1], dtype=jnp.int32)
    ids = jax.vmap(lambda out, s: out.at[s].set(blocks, mode="drop"))(ids, slot)
    return ids.reshape(*lead, k)
