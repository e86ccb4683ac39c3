"""The MoE's grouped matmul as Pallas Triton kernels: ``out[u] = lhs[u] @ rhs[e]`` for the rows ``u`` of group
``e`` (rows sorted by group), and its two gradients, each computing only the groups' own rows.

Why by hand: XLA:GPU (jax 0.11.2) lowers ``lax.ragged_dot`` and its transposes densely: every group's rows are
copied into a masked [E, U, X] array and multiplied by every expert (an H200, ``configs/small.yaml``'s layer of
16 experts, 32,768 rows × 1024 → 768 / 384, ``BENCHMARKS.md``: 7.5 ms forward + backward for 232 GFLOP of
products, 3 % of the bf16 peak, the GEMMs doing 16× the work and the masked copies writing 2 GB), and tokamax's
kernels cover the forward only (its backward was measured wrong; ``dsv41_jax.model.moe._grouped``).

Row tiles: each group's rows are cut into tiles of ``BM`` rows (:func:`schedule`: ``ceil(rows / BM) + E``
tiles at most, static); a tile never mixes groups, its rows past the group's end are masked. Forward and the
input gradient: a program per (tile, column block) runs the K loop on the tensor cores (``jnp.dot`` ->
``tt.dot``) with fp32 accumulation. Weight gradient ``lhs_eᵀ · g_e``: a program per (expert, row block, column
block) loops over its group's row tiles (a trip count of the group's size). Rows past the last group are zero
in the outputs.

Measured (an H100, jax 0.11.2, that layer at 8K tokens, profiler busy time, ``BENCHMARKS.md``): the layer's
forward + backward 8,334 µs with XLA, 1,061 µs with these kernels at the tuned blocks (7.9×; the products at
~220 TFLOP/s, 22 % of the bf16 peak); the kernels alone run at 240-330 TFLOP/s (row kernel) and 420-440 TFLOP/s
(weight gradient). Neither limit binds: the gate and up projection's forward, 156 µs, is at 33 % of the bf16
peak and moves ~190 MB (57 µs at the H100's 3.35 TB/s; its fp32 output is half of that); the 64-row tiles that
keep groups apart are what a larger tile (or a persistent, warp-specialised kernel) would improve on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

# Defaults from ``python benchmarks/moe_bench.py --tune`` (an H100, jax 0.11.2, ``configs/small.yaml``'s layer at
# 8K tokens; BENCHMARKS.md): the row kernel at 64 rows × 256 columns × 32 contraction, 4 warps, 4 stages; the weight
# gradient at 128 × 128 output blocks, 32 rows a step, 4 warps, 3 stages.
BM, BN, BK = 64, 256, 32  # rows a tile, output columns a program, contraction a step
WARPS, STAGES = 4, 4
W_BX, W_BY, W_BK, W_WARPS, W_STAGES = 128, 128, 32, 4, 3  # the weight gradient's


def schedule(sizes: Int[Array, " E"], rows: int, bm: int = BM):
    """``(group, first, end)`` of every row tile: ``ceil(rows / bm) + E`` tiles, those past the last group's empty
    (``end == first``). Tile ``t`` of group ``e`` covers rows ``[first, min(first + bm, end))``."""
    e = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    ntiles = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(ntiles)
    t = jnp.arange(-(-rows // bm) + e, dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    g = jnp.minimum(group, e - 1)
    first = ends[g] - sizes[g] + (t - (tile_end[g] - ntiles[g])) * bm
    end = jnp.where(group < e, ends[g], first)
    return g, jnp.where(group < e, first, 0), jnp.where(group < e, end, 0)


# fp32 operands multiply as fp32 (Triton's default precision would round them to TF32); bf16 ones are unaffected
_EXACT = jax.lax.Precision.HIGHEST


def _rows_kernel(group_ref, first_ref, end_ref, x_ref, w_ref, o_ref, *, bm: int, bn: int, bk: int, k: int):
    t, j = pl.program_id(0), pl.program_id(1)
    e, first, end = group_ref[t], first_ref[t], end_ref[t]
    ok = (first + jnp.arange(bm) < end)[:, None]
    rows, cols = pl.ds(first, bm), pl.ds(j * bn, bn)

    def step(i, acc):
        a = plt.load(x_ref.at[rows, pl.ds(i * bk, bk)], mask=ok, other=0)
        return acc + jnp.dot(a, w_ref[e, pl.ds(i * bk, bk), cols], precision=_EXACT,
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((bm, bn), jnp.float32))
    plt.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=ok)


def _weights_kernel(starts_ref, sizes_ref, x_ref, g_ref, o_ref, *, bm: int, bx: int, by: int):
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = starts_ref[e], sizes_ref[e]
    xs, ys = pl.ds(i * bx, bx), pl.ds(j * by, by)

    def step(r, acc):
        first = start + r * bm
        ok = (first + jnp.arange(bm) < start + size)[:, None]
        a = plt.load(x_ref.at[pl.ds(first, bm), xs], mask=ok, other=0)
        g = plt.load(g_ref.at[pl.ds(first, bm), ys], mask=ok, other=0)
        return acc + jnp.dot(a.T, g, precision=_EXACT, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, (size + bm - 1) // bm, step, jnp.zeros((bx, by), jnp.float32))
    o_ref[e, xs, ys] = acc.astype(o_ref.dtype)


def _pad(a: jax.Array, rows: int, interpret: bool) -> jax.Array:
    # the interpreter's loads and stores clamp a window that runs past the array instead of masking it
    return jnp.pad(a, ((0, rows), (0, 0))) if interpret else a


def _block(n: int, want: int) -> int:
    """The largest power of two up to ``want`` dividing ``n`` (Triton's blocks are powers of two), at least 16."""
    b = want
    while b > 16 and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"grouped_matmul kernels: a dimension of {n} is not a multiple of 16")
    return b


_TUNING = ("bm", "bn", "bk", "warps", "stages")


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", *_TUNING))
def rows_matmul(lhs: Float[Array, "U X"], rhs: Float[Array, "E X Y"], sizes: Int[Array, " E"], *,
                out_dtype=jnp.float32, interpret: bool = False, bm: int = BM, bn: int = BN, bk: int = BK,
                warps: int = WARPS, stages: int = STAGES) -> Float[Array, "U Y"]:
    """``lax.ragged_dot(lhs, rhs, sizes)``: the forward, and the input gradient against ``rhs`` transposed.
    ``bm`` rows a tile, ``bn`` output columns a program, ``bk`` contraction a step (``bn`` and ``bk`` shrink to
    divide the experts' dimensions), ``warps`` and ``stages`` Triton's."""
    (u, x), y = lhs.shape, rhs.shape[2]
    bn, bk = _block(y, bn), _block(x, bk)
    group, first, end = schedule(sizes, u, bm)
    out = pl.pallas_call(
        functools.partial(_rows_kernel, bm=bm, bn=bn, bk=bk, k=x),
        out_shape=jax.ShapeDtypeStruct((u + (bm if interpret else 0), y), out_dtype),
        grid=(group.shape[0], y // bn),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        name="grouped_rows_matmul",
    )(group, first, end, _pad(lhs, bm, interpret), rhs)[:u]
    return jnp.where((jnp.arange(u) < jnp.sum(sizes))[:, None], out, 0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", *_TUNING))
def weights_matmul(lhs: Float[Array, "U X"], g: Float[Array, "U Y"], sizes: Int[Array, " E"], *,
                   out_dtype=jnp.float32, interpret: bool = False, bm: int = W_BX, bn: int = W_BY,
                   bk: int = W_BK, warps: int = W_WARPS, stages: int = W_STAGES) -> Float[Array, "E X Y"]:
    """``out[e] = lhs_eᵀ · g_e`` over each group's rows: ``lax.ragged_dot``'s gradient with respect to ``rhs``.
    ``bm`` × ``bn`` an output block a program (shrunk to divide ``X`` and ``Y``), ``bk`` rows a step."""
    (_, x), y, e = lhs.shape, g.shape[1], sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    bx, by = _block(x, bm), _block(y, bn)
    return pl.pallas_call(
        functools.partial(_weights_kernel, bm=bk, bx=bx, by=by),
        out_shape=jax.ShapeDtypeStruct((e, x, y), out_dtype),
        grid=(e, x // bx, y // by),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        name="grouped_weights_matmul",
    )(jnp.cumsum(sizes) - sizes, sizes, _pad(lhs, bk, interpret), _pad(g, bk, interpret))


def applies(lhs: jax.Array, rhs: jax.Array) -> bool:
    """Whether the kernels take these shapes: the experts' both dimensions multiples of 16."""
    return lhs.ndim == 2 and rhs.ndim == 3 and rhs.shape[1] % 16 == 0 and rhs.shape[2] % 16 == 0
