"""Sparse MQA forward on TPU through Mosaic TPU (``pltpu``); runs on CPU with ``interpret=True``.

The same computation as ``mosaic.sparse_mqa`` (each query's heads against its own list of key rows, the sink
in the denominator, log-sum-exp out), shaped for a TPU core: a grid step a query, all its heads at once. The
key rows stay in HBM and are gathered a tile of 64 at a time by one DMA a row into a VMEM slot (two slots:
the next tile's DMAs are in flight while this tile is computed); the row list is read twice, as scalars in
SMEM (the DMA addresses) and as a vector in VMEM (the −∞ mask). Products on the MXU in fp32 accumulation,
online softmax in fp32, P cast to the activation dtype before P·V, as ``reference.sparse_mqa``.

:func:`sparse_mqa_bwd` is the backward of the same computation, a grid step a query as well: all of its L key
rows gathered into VMEM at once (640 × 512 bf16 = 640 KB at the release geometry, with the [N, L] fp32
probabilities beside them: far inside a core's VMEM), the probabilities recomputed from the forward's
log-sum-exp, then dQ, each listed row's dK (``dSᵀ·Q + Pᵀ·dO``, fp32) and Σ p·dp per head (the sink's gradient)
in one pass, with ``api``'s XLA backward's formula and roundings. Summing each query's row gradients into the
key arrays (an entry is listed by many queries) is left to one fp32 scatter after the kernel.

Not yet run on TPU hardware: their numerics are the interpreter's (tests/kernels/test_sparse_attention.py),
their speed unmeasured. One DMA descriptor a row (640 a query at the release geometry) is the open question
there; TPU DMAs have no gather form in Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

KEYS = 64  # key rows a tile


def _start_rows(idx_smem, i, b, first, count: int, main_hbm, extra_hbm, n_main: int, dst, sem) -> None:
    """Start one DMA a row for rows ``first .. first + count − 1`` of query ``i``'s list, from ``main`` or
    ``extra`` into ``dst(r)`` (−1 entries read row 0 of ``main``; the kernels mask them)."""
    def one(r, carry):
        e = jnp.maximum(idx_smem[i, first + r], 0)
        in_main = e < n_main
        pl.when(in_main)(pltpu.make_async_copy(main_hbm.at[b, pl.ds(jnp.minimum(e, n_main - 1), 1)], dst(r),
                                               sem).start)
        pl.when(jnp.logical_not(in_main))(pltpu.make_async_copy(
            extra_hbm.at[b, pl.ds(jnp.maximum(e - n_main, 0), 1)], dst(r), sem).start)
        return carry
    lax.fori_loop(0, count, one, 0)


def _wait_rows(main_hbm, b, count: int, dst, sem) -> None:
    """Wait for :func:`_start_rows`' ``count`` copies: every row copy has the same size, so one descriptor of that
    size a row."""
    def one(r, carry):
        pltpu.make_async_copy(main_hbm.at[b, pl.ds(0, 1)], dst(r), sem).wait()
        return carry
    lax.fori_loop(0, count, one, 0)


def _kernel(idx_smem, idx_ref, q_ref, sink_ref, main_hbm, extra_hbm, o_ref, lse_ref, kbuf, sem, *,
            scale: float, s_len: int, n_main: int):
    i = pl.program_id(0)
    b = i // s_len
    n_tiles = idx_ref.shape[-1] // KEYS

    def start(t, slot):
        _start_rows(idx_smem, i, b, t * KEYS, KEYS, main_hbm, extra_hbm, n_main,
                    lambda r: kbuf.at[slot, pl.ds(r, 1)], sem.at[slot])

    def wait(slot):
        _wait_rows(main_hbm, b, KEYS, lambda r: kbuf.at[slot, pl.ds(r, 1)], sem.at[slot])

    q = q_ref[0]  # [N, H]
    n = q.shape[0]
    start(0, 0)

    def step(t, carry):
        o, m, l_ = carry
        slot = lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            start(t + 1, 1 - slot)
        wait(slot)
        keys = kbuf[slot]  # [KEYS, H]
        logits = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        ok = idx_ref[0, :, pl.ds(t * KEYS, KEYS)] >= 0  # [1, KEYS]
        logits = jnp.where(ok, logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new)
        l_ = l_ * alpha + p.sum(axis=1, keepdims=True)
        o = o * alpha + jnp.dot(p.astype(q.dtype), keys, preferred_element_type=jnp.float32)
        return o, m_new, l_

    m0 = sink_ref[...].astype(jnp.float32).reshape(n, 1)  # the sink starts the running max and denominator
    init = (jnp.zeros(q.shape, jnp.float32), m0, jnp.ones((n, 1), jnp.float32))
    o, m, l_ = lax.fori_loop(0, n_tiles, step, init)
    o_ref[0] = (o / l_).astype(o_ref.dtype)
    lse_ref[0] = (m + jnp.log(l_)).reshape(1, n)


def _query_rows(name: str, q, main, extra, idx):
    """``(B, S, N, H, L, row lists [B·S, L] int32)`` of a kernel call, or a ValueError naming what does not fit."""
    b, s, n, h = q.shape
    L = idx.shape[-1]
    if L % KEYS or idx.shape[:2] != (b, s) or main.shape[::2] != (b, h) or extra.shape[::2] != (b, h):
        raise ValueError(f"{name} TPU kernel: q {q.shape}, keys {main.shape} + {extra.shape}, idx {idx.shape}: "
                         f"needs L a multiple of {KEYS} and matching B, S, H")
    return b, s, n, h, L, idx.astype(jnp.int32).reshape(b * s, L)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def sparse_mqa(q: Float[Array, "B S N H"], main: Float[Array, "B T H"], extra: Float[Array, "B E H"],
               idx: Int[Array, "B S L"], sink: Float[Array | np.ndarray, "N"], scale: float, *, interpret: bool = False
               ) -> tuple[Float[Array, "B S N H"], Float[Array, "B S N"]]:
    """``reference.sparse_mqa`` as a Mosaic TPU kernel; L a multiple of 64 (``layout.key_rows`` pads it)."""
    b, s, n, h, L, rows = _query_rows("sparse_mqa", q, main, extra, idx)
    out, lse = pl.pallas_call(
        functools.partial(_kernel, scale=scale, s_len=s, n_main=main.shape[1]),
        out_shape=(jax.ShapeDtypeStruct((b * s, n, h), q.dtype), jax.ShapeDtypeStruct((b * s, 1, n), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b * s,),
            in_specs=[pl.BlockSpec((1, 1, L), lambda i, _: (i, 0, 0)),
                      pl.BlockSpec((1, n, h), lambda i, _: (i, 0, 0)),
                      pl.BlockSpec((1, n), lambda i, _: (0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((1, n, h), lambda i, _: (i, 0, 0)),
                       pl.BlockSpec((1, 1, n), lambda i, _: (i, 0, 0))],
            scratch_shapes=[pltpu.VMEM((2, KEYS, h), q.dtype), pltpu.SemaphoreType.DMA((2,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(rows, rows.reshape(b * s, 1, L), q.reshape(b * s, n, h), sink.astype(jnp.float32).reshape(1, n),
      main.astype(q.dtype), extra.astype(q.dtype))
    return out.reshape(b, s, n, h), lse.reshape(b, s, n)


def _bwd_kernel(idx_smem, idx_ref, q_ref, g_ref, lse_ref, main_hbm, extra_hbm, dq_ref, dk_ref, delta_ref, kbuf, sem,
                *, scale: float, s_len: int, n_main: int):
    i = pl.program_id(0)
    b = i // s_len
    n_rows = idx_ref.shape[-1]
    _start_rows(idx_smem, i, b, 0, n_rows, main_hbm, extra_hbm, n_main, lambda r: kbuf.at[pl.ds(r, 1)], sem.at[0])
    _wait_rows(main_hbm, b, n_rows, lambda r: kbuf.at[pl.ds(r, 1)], sem.at[0])
    q, g, keys = q_ref[0], g_ref[0], kbuf[...]  # [N, H], [N, H], [L, H]
    dt = q.dtype
    nt = (((1,), (1,)), ((), ()))  # a · bᵀ
    tn = (((0,), (0,)), ((), ()))  # aᵀ · b
    logits = lax.dot_general(q, keys, nt, preferred_element_type=jnp.float32) * scale  # [N, L]
    ok = idx_ref[0] >= 0  # [1, L]
    lse = lse_ref[0].reshape(q.shape[0], 1)
    p = jnp.where(ok, jnp.exp(logits - lse), 0.0)
    dp = lax.dot_general(g, keys, nt, preferred_element_type=jnp.float32)
    delta = (p * dp).sum(axis=1, keepdims=True)  # [N, 1]
    ds = (p * (dp - delta) * scale).astype(dt)
    dq_ref[0] = jnp.dot(ds, keys, preferred_element_type=jnp.float32).astype(dq_ref.dtype)
    dk_ref[0] = (lax.dot_general(ds, q, tn, preferred_element_type=jnp.float32)
                 + lax.dot_general(p.astype(dt), g, tn, preferred_element_type=jnp.float32))
    delta_ref[0] = delta.reshape(1, q.shape[0])


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def sparse_mqa_bwd(q: Float[Array, "B S N H"], main: Float[Array, "B T H"], extra: Float[Array, "B E H"],
                   idx: Int[Array, "B S L"], lse: Float[Array, "B S N"], g: Float[Array, "B S N H"], scale: float, *,
                   interpret: bool = False
                   ) -> tuple[Float[Array, "B S N H"], Float[Array, "B S L H"], Float[Array, "B S N"]]:
    """``(dq, dkeys, delta)`` of :func:`sparse_mqa` for the output cotangent ``g``: dQ in ``q``'s dtype, each
    listed row's key gradient in fp32 (zero where ``idx`` is −1; summed into ``main`` / ``extra`` by the
    caller) and Σ_l p_l·dp_l per head (fp32), from the forward's ``lse``."""
    b, s, n, h, L, rows = _query_rows("sparse_mqa_bwd", q, main, extra, idx)
    per_query = lambda i, _: (i, 0, 0)  # noqa: E731
    dq, dk, delta = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, s_len=s, n_main=main.shape[1]),
        out_shape=(jax.ShapeDtypeStruct((b * s, n, h), q.dtype), jax.ShapeDtypeStruct((b * s, L, h), jnp.float32),
                   jax.ShapeDtypeStruct((b * s, 1, n), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b * s,),
            in_specs=[pl.BlockSpec((1, 1, L), per_query), pl.BlockSpec((1, n, h), per_query),
                      pl.BlockSpec((1, n, h), per_query), pl.BlockSpec((1, 1, n), per_query),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((1, n, h), per_query), pl.BlockSpec((1, L, h), per_query),
                       pl.BlockSpec((1, 1, n), per_query)],
            scratch_shapes=[pltpu.VMEM((L, h), q.dtype), pltpu.SemaphoreType.DMA((1,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(rows, rows.reshape(b * s, 1, L), q.reshape(b * s, n, h), g.astype(q.dtype).reshape(b * s, n, h),
      lse.astype(jnp.float32).reshape(b * s, 1, n), main.astype(q.dtype), extra.astype(q.dtype))
    return dq.reshape(b, s, n, h), dk.reshape(b, s, L, h), delta.reshape(b, s, n)
