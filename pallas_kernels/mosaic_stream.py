"""What the Mosaic GPU (``plgpu``) kernels of every op (fp4_pack, block_max) share: a persistent,
multi-buffered TMA streaming loop (:func:`stream`, launched by :func:`kernel`), the register layout with
one row a thread (:func:`rows_layout`), SMEM loads into it (:func:`load`), the registers of such an array
as inline-PTX operands (:func:`words_of`), and the launch helpers :func:`num_sms` and
:func:`interpret_params`.

In :func:`stream` each CTA (one warpgroup) walks the tiles ``c, c + n_ctas, c + 2 n_ctas, ...``. Tile
loads go through TMA into ``stages`` SMEM slots, each slot with its own barrier, so up to ``stages - 1``
loads are in flight while a tile is computed. Results go to one of two SMEM output buffers and leave through TMA stores;
before a buffer is rewritten, the store issued from it two tiles earlier must have finished reading it.

The loop is written with the explicit copy / barrier primitives rather than ``plgpu.emit_pipeline``:
the predicated output copies of ``emit_pipeline`` have no GPU interpret-mode rule in jax 0.10, and the
explicit form runs unchanged in that interpreter (``interpret_params``), which is how its
synchronisation and indexing are checked on a CPU-only jaxlib.

Two things differ between the compiled kernel and the interpreter, so kernel bodies branch on
``interpret``: register layouts (``plgpu.layout_cast`` has no interpret rule) and ref reshapes (the GPU
interpreter rejects ``ReshapeTransform``). Bodies therefore reshape values when interpreted and refs
when compiled; both orders are row-major, so the data movement is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CTA_AXIS = "cta"
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM
ROW_VECTOR = 4  # elements per vector register of rows_layout: 16 bytes of 32-bit data


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 when it cannot be read, e.g. on CPU)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_NUM_SMS
    return int(getattr(dev, "core_count", 0) or DEFAULT_NUM_SMS) if dev.platform == "gpu" else DEFAULT_NUM_SMS


def interpret_params():
    """GPU interpret mode that lets the last tile overhang the arrays, as TMA does (reads there are
    uninitialised, writes there are dropped); callers must not depend on the overhanging values."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def rows_layout(p: int):
    """[C, p] arrays (p a multiple of 4) with one row per thread: 4 warps x 32 lanes over 128 rows, the
    row's p elements in vectors of ``ROW_VECTOR`` (16-byte SMEM accesses for 32-bit data); row reductions
    stay inside the thread. Written in Mosaic GPU's canonical form of the tiling (128, p)(32, p)(1, 4)."""
    if p % ROW_VECTOR:
        raise ValueError(f"rows_layout: the row length ({p}) must be a multiple of {ROW_VECTOR}")
    if p == ROW_VECTOR:
        return plgpu.Layout.TILED(plgpu.Tiling(((128, 4), (32, 4))), warp_dims=(-4,), lane_dims=(-2,), vector_dim=-1)
    return plgpu.Layout.TILED(plgpu.Tiling(((128, p), (32, p), (4,))), warp_dims=(-5,), lane_dims=(-3,),
                              vector_dim=-1)


def words_of(arr):
    """A 32-bit ``FragmentedArray`` in :func:`rows_layout` (registers of ``vector<4 x i32>``) -> its registers
    as lists of ``ROW_VECTOR`` i32 MLIR values, in register order: operands for inline PTX inside a
    ``plgpu.inline_mgpu`` body (compiled path only)."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    out = []
    for reg in arr.registers.flat:
        if ir.VectorType(reg.type).shape != [ROW_VECTOR]:
            raise ValueError(f"words_of: the array must be in rows_layout (vectors of {ROW_VECTOR} words a "
                             f"register), got registers of {reg.type}")
        out.append([llvm.extractelement(reg, mu.c(j, i32)) for j in range(ROW_VECTOR)])
    return out


def load(ref, layout):
    """Whole-ref SMEM load into ``layout`` (compiled path). ``optimized=False``: row-major tiles whose rows
    are narrower than 128 bytes have no bank-conflict-free plan, and the plain schedule is fine there."""
    return plgpu.load(ref, (), layout=layout, optimized=False)


def stream(*, n_tiles: int, n_ctas: int, stages: int, barrier,
           load: Callable[[jax.Array, jax.Array], None],
           compute: Callable[[jax.Array, jax.Array, jax.Array], None],
           store: Callable[[jax.Array, jax.Array], None]) -> None:
    """Run the tiles of this CTA. Call inside a ``plgpu.kernel`` body with grid axis ``CTA_AXIS``.

    ``load(tile, slot)`` issues the TMA copies of a tile into input slot ``slot`` (each onto
    ``barrier.at[slot]``); ``compute(tile, slot, buf)`` reads input slot ``slot`` and writes output
    buffer ``buf`` (0 or 1) through plain SMEM stores; ``store(tile, buf)`` issues the TMA stores of
    output buffer ``buf`` as one bulk group (``commit_group=True`` on its last copy only).
    """
    c = lax.axis_index(CTA_AXIS)
    steps = (n_tiles - 1 - c) // n_ctas + 1  # n_ctas <= n_tiles: every CTA has at least one tile

    def tile(k):
        return c + k * n_ctas

    for s in range(stages):  # prologue: fill the slots
        @pl.when(s < steps)
        def _(s=s):  # runs now (pl.when traces its body immediately)
            load(tile(s), s)

    def step(k, carry):
        slot, buf = lax.rem(k, stages), lax.rem(k, 2)
        plgpu.barrier_wait(barrier.at[slot])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from buffer `buf` (tile k-2) has read it
        compute(tile(k), slot, buf)
        plgpu.commit_smem()  # all threads done with slot and buffer; SMEM writes visible to TMA
        store(tile(k), buf)

        @pl.when(k + stages < steps)
        def _():
            load(tile(k + stages), slot)

        return carry

    lax.fori_loop(0, steps, step, 0)
    plgpu.wait_smem_to_gmem(0)


def kernel(body, *, out_type, scratch_types, n_ctas: int, interpret: bool, no_auto_barriers: bool = False):
    """``plgpu.kernel`` over ``n_ctas`` CTAs of one warpgroup each, on grid axis ``CTA_AXIS``."""
    kw = {}
    if no_auto_barriers:
        kw["compiler_params"] = plgpu.CompilerParams(unsafe_no_auto_barriers=True)
    if interpret:
        kw["interpret"] = interpret_params()
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch_types, grid=(n_ctas,),
                        grid_names=(CTA_AXIS,), **kw)
