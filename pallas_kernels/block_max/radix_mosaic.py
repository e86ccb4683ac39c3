"""The radix select's passes (``select.kth_largest_key``) as Mosaic GPU kernels: one kernel a pass.

In XLA a pass is three kernels (the count over key chunks, the sum over chunks with the digit, the prefix
update), because XLA materialises between reductions. Here each CTA of pass p first finishes pass p - 1 for
its row: one TMA copy brings the row's C per-CTA partials (C x 128 int32) into SMEM, a vector sum over C
gives the row's 15 counts in 15 lanes, and one cross-warp reduction the digit. Then it counts its own keys.

The keys are the block maxima's f32 bits, [R * C * T * 128, P] rows of P = 32 (CTA (r, c) owns T tiles of
128 rows), turned into the signed order key in registers (:func:`signed_key`: ``select.order_key`` with the
sign bit flipped, so int32 order is the keys' order); padding is -1, which becomes INT32_MIN, below every
threshold (thresholds are >= 1 as uint32). In registers a tile is [128, P] with one row per thread
(``mosaic_stream.rows_layout``): the 15 compares and sums of a row stay in the thread; the 15 per-thread
counters cross the warpgroup two to a word (each CTA count is below 2^16). A CTA writes 128 int32: its 15
counts and, at index 15, the prefix it counted against.

On the H200 (BENCHMARKS.md) a pass is ~4.5 µs at [8, 131072] keys (256 CTAs of one tile), but the
15-compare count is slow where a CTA holds several tiles (~33 µs a pass at [32, 131072]); there
``radix_cluster`` (the whole search in one kernel) is faster, and ``select.pick_kernel`` chooses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms

P = 32  # keys per thread row (128 bytes)
TILE = 128 * P  # keys per TMA tile
OUT = 128  # int32 per CTA partial: 15 counts, the prefix at index 15, zeros
DIGIT_BITS = 4  # as select's XLA passes
BINS = 1 << DIGIT_BITS
_SIGN = -(1 << 31)


def _i32(v: int) -> int:
    """A 32-bit pattern as a Python int in int32's range."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


MAX_CTAS_PER_ROW = 128  # each CTA of the next pass reads the row's C x 128 partials into SMEM
MAX_TILES_PER_CTA = 8  # 16 KB each in SMEM, all in flight (with 128 x 512 B of partials: 192 KB)


def geometry(r: int, n: int, target_ctas: int = 2 * ms.DEFAULT_NUM_SMS) -> tuple[int, int] | None:
    """(CTAs per row C, tiles per CTA T) for R rows of N keys: about ``target_ctas`` CTAs in all, at most
    64 a row unless the tiles would not fit in SMEM; None past 128 CTAs x 8 tiles (4.2 M keys) a row."""
    tiles = -(-n // TILE)
    c = max(1, min(tiles, -(-target_ctas // r), 64))
    c = max(c, -(-tiles // MAX_TILES_PER_CTA))
    return (c, -(-tiles // c)) if c <= MAX_CTAS_PER_ROW else None


def supports(n: int) -> bool:
    return geometry(1, n) is not None


def to_kernel_rows(x, c: int, t: int):
    """f32 [R, N] -> its int32 bits [R * C * T * 128, P], padded with -1 (the bits of a NaN that the kernel
    maps to the lowest key, INT32_MIN)."""
    r, n = x.shape
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    if c * t * TILE != n:
        b = jnp.pad(b, ((0, 0), (0, c * t * TILE - n)), constant_values=-1)
    return b.reshape(r * c * t * 128, P)


def signed_key(bits):
    """f32 bits (int32) -> the signed order key: ``select.order_key``'s uint32 with the sign bit flipped."""
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def pack_pairs(counts):
    """Counts (each < 2^16) two to an int32, count 2i in the low half of word i: half the cross-warp
    reductions (a sum of packed words is the packed sums while each sum stays below 2^16)."""
    return [a + (counts[i + 1] << 16) if i + 1 < len(counts) else a for i, a in enumerate(counts) if i % 2 == 0]


def unpack_pairs(words, n: int):
    """The inverse of :func:`pack_pairs`: words -> the first ``n`` counts."""
    out = []
    for w in words:
        out += [w & 0xFFFF, lax.shift_right_logical(w, 16)]
    return out[:n]


@functools.partial(jax.jit, static_argnames=("shift", "prev_shift", "c", "t", "interpret"))
def count_pass(rows, prev, k, *, shift: int, prev_shift: int | None, c: int, t: int, interpret: bool = False):
    """One pass: ``rows`` from :func:`to_kernel_rows`, ``prev`` [R, C, 128] the previous pass's partials
    (None for the first pass, ``prev_shift=None``), ``k`` an int32 [1] -> this pass's partials
    [R, C, 128]."""
    n_rows = rows.shape[0] // (c * t * 128)
    n_ctas = n_rows * c
    first = prev_shift is None
    vec = plgpu.Layout.WG_STRIDED((OUT,), vec_size=1)

    def body(keys_gmem, *refs):
        if first:
            k_gmem, out_gmem, k_buf, o_buf, barrier = refs
        else:
            prev_gmem, k_gmem, out_gmem, k_buf, p_buf, o_buf, barrier = refs
        cta = lax.axis_index(ms.CTA_AXIS)
        row = cta // c
        for i in range(t):  # all of this CTA's tiles in flight at once
            plgpu.copy_gmem_to_smem(keys_gmem.at[pl.ds((cta * t + i) * 128, 128)], k_buf.at[i], barrier.at[i])
        if interpret:
            lane = lax.broadcasted_iota(jnp.int32, (OUT,), 0)
        else:
            lane = plgpu.broadcasted_iota(jnp.int32, (OUT,), 0, layout=vec)
        if first:
            prefix = jnp.int32(0)
        else:  # finish pass p - 1: the row's counts from its C partials, one vector load a partial
            plgpu.copy_gmem_to_smem(prev_gmem.at[row], p_buf, barrier.at[t])
            plgpu.barrier_wait(barrier.at[t])
            total = sum(p_buf[ci] if interpret else ms.load(p_buf.at[ci], vec) for ci in range(c))
            digit = jnp.sum(jnp.where((lane < BINS - 1) & (total >= k_gmem[0]), 1, 0))  # counts fall with j
            prefix = p_buf[0, BINS - 1] | (digit << prev_shift)
        thresholds = [(prefix | _i32(j << shift)) ^ _SIGN for j in range(1, BINS)]  # signed order of the keys
        if interpret:
            counts = [jnp.int32(0)] * (BINS - 1)
            for i in range(t):
                plgpu.barrier_wait(barrier.at[i])
                x = signed_key(k_buf[i])
                counts = [a + jnp.sum((x >= th).astype(jnp.int32)) for a, th in zip(counts, thresholds, strict=True)]
        else:
            reg = ms.rows_layout(P)
            acc = None
            for i in range(t):
                plgpu.barrier_wait(barrier.at[i])
                x = signed_key(ms.load(k_buf.at[i], reg))
                hits = [jnp.sum((x >= th).astype(jnp.int32), axis=1) for th in thresholds]  # [128] per thread
                acc = hits if acc is None else [a + h for a, h in zip(acc, hits, strict=True)]
            counts = unpack_pairs([jnp.sum(w) for w in pack_pairs(acc)], BINS - 1)  # across the warpgroup
        out = jnp.where(lane == BINS - 1, prefix, 0)
        for j, a in enumerate(counts):
            out = jnp.where(lane == j, a, out)
        o_buf[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_buf, out_gmem.at[cta])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((t, 128, P), jnp.int32)]
    if not first:
        scratch.append(plgpu.SMEM((c, OUT), jnp.int32))
    scratch += [plgpu.SMEM((OUT,), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=t + (not first))]
    args = (rows, k) if first else (rows, prev.reshape(n_rows, c, OUT), k)
    out = ms.kernel(body, out_type=jax.ShapeDtypeStruct((n_ctas, OUT), jnp.int32), scratch_types=scratch,
                    n_ctas=n_ctas, interpret=interpret)(*args)
    return out.reshape(n_rows, c, OUT)


def kth_largest_key(x, k: int, *, target_ctas: int = 2 * ms.DEFAULT_NUM_SMS, interpret: bool = False):
    """``select.kth_largest_key(select.order_key(x), k)`` for f32 rows ``x`` [R, N] (uint32 [R]), one
    Mosaic GPU kernel a pass. Raises past 4.2 M keys a row (:func:`supports`)."""
    r, n = x.shape
    geo = geometry(r, n, target_ctas)
    if geo is None:
        raise ValueError(f"radix_mosaic: rows of {n} keys exceed {MAX_CTAS_PER_ROW} CTAs x {MAX_TILES_PER_CTA} "
                         f"tiles of {TILE}")
    c, t = geo
    rows = to_kernel_rows(x, c, t)
    k_arr = jnp.full((1,), k, jnp.int32)  # traced: one compile for every k
    part, prev_shift = None, None
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        part = count_pass(rows, part, k_arr, shift=shift, prev_shift=prev_shift, c=c, t=t, interpret=interpret)
        prev_shift = shift
    counts = part[..., : BINS - 1].sum(axis=1)  # the last pass, finished in XLA (its shift is 0)
    digit = jnp.sum(counts >= k, axis=1, dtype=jnp.int32)  # as select.digit_from_counts, in int32 bits
    return lax.bitcast_convert_type(part[:, 0, BINS - 1] | digit, jnp.uint32)
