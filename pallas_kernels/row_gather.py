"""Rows of a matrix gathered by index, as a Pallas Triton kernel: ``out[i] = x[idx[i]]``.

The MoE moves its token copies into expert order and back by row permutations (``moe._to_copies`` /
``moe._from_copies``). XLA emits such a gather as a fusion whose output layout follows its consumers; in the
train step's rematerialised forward, the copies feed the weight gradient's ``ragged_dot`` too, and those
gathers ran at ~60 GB/s (H100, ``BENCHMARKS.md``). A Pallas call is a custom call: its output is row-major,
whatever reads it, so each program reads whole rows and writes them contiguously, and any other layout a
consumer wants is XLA's own transpose after it.

Hand-written because no library offers a row gather whose output layout is pinned; ~30 lines.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

ROWS = 16  # rows a program


def _kernel(idx_ref, x_ref, o_ref, *, rows: int, width: int, block: int):
    i = pl.program_id(0)
    lanes = pl.program_id(1) * block + jnp.arange(block)
    src = idx_ref[pl.ds(i * rows, rows)]
    o_ref[pl.ds(i * rows, rows), pl.ds(pl.program_id(1) * block, block)] = x_ref[src[:, None], lanes[None, :]]


@functools.partial(jax.jit, static_argnames=("interpret",))
def gather_rows(x: Float[Array, "N D"], idx: Int[Array, " M"], *, interpret: bool = False) -> Float[Array, "M D"]:
    """``x[idx]`` for in-bounds ``idx`` (the caller's promise: out-of-range rows are not checked).

    ``M`` must be a multiple of :data:`ROWS` and ``D`` of 128 (the MoE's copies: tokens × K rows of the model
    dim); :func:`applies` says whether a call takes the kernel."""
    m, (_, d) = idx.shape[0], x.shape
    if not applies(x, idx):
        raise ValueError(f"gather_rows: {m} rows of width {d}; needs rows % {ROWS} == 0 and width % 128 == 0")
    block = max(b for b in (128, 256, 512, 1024) if d % b == 0)
    return pl.pallas_call(
        functools.partial(_kernel, rows=ROWS, width=d, block=block),
        out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
        grid=(m // ROWS, d // block),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="gather_rows",
    )(idx.astype(jnp.int32), x)


def applies(x: jax.Array, idx: jax.Array) -> bool:
    return x.ndim == 2 and idx.ndim == 1 and idx.shape[0] % ROWS == 0 and x.shape[1] % 128 == 0
