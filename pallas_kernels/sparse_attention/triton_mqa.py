"""Sparse MQA on GPU for few heads, forward and backward: Pallas (Triton) kernels over each query's row list.

Each query attends with its ``N`` heads to its own list of key rows (``idx``, rows of ``main ++ extra``, K = V)
with the per-head sink in the denominator (``reference.sparse_mqa``). The Mosaic GPU forward (``mosaic.py``) runs
a query's heads as the 64 rows of a ``wgmma``: at 16 heads (``configs/small.yaml``) three quarters of that work is
padding. These kernels take ``HEADS`` = 16 heads a program and read the rows by index from the key array (each
entry is read by many queries, so mostly from L2). No library kernel takes this shape (a per-query row list, K =
V at head dim 256–512, the sink), hence these.

:func:`sparse_mqa` (forward): one program a query and 16 heads; an online softmax over the list, ``KEYS`` rows a
tile (``keys``), started at the sink (so a head with no visible key is well defined); P rounded to the activation dtype
before P·V against the running max (the Mosaic kernel's rounding point); out the output and the log-sum-exp.

:func:`sparse_mqa_bwd` (backward, from that log-sum-exp). The XLA gradient (``api._query_grads``) gathers every
query's L rows ([S, L, H] keys, 2.1 GB a layer at 8K × 512 × 256 bf16, and again for the row gradients in
fp32), runs per-query products of N rows, then sums the row gradients into the entries with an fp32 scatter.
This kernel adds each row's gradient straight into an fp32 dKV with the GPU's native fp32 atomics instead, with
relaxed ordering (``triton_atomics``: Pallas's own adds wait on a memory barrier each; an entry collects the
gradients of the queries that picked it, in no fixed order), in two passes over the list:

1. the probabilities ``p = exp(q·k·scale − lse)`` and ``dp = dO·k`` give ``Σ_l p_l dp_l`` per head (from the
   probabilities themselves, not ``dO·O``: O was rounded to the activation dtype, and ``dp − Σ p·dp`` cancels where
   one key dominates);
2. again ``p`` and ``dp``, then ``ds = p (dp − Σ p·dp) scale`` rounded to the activation dtype, ``dQ += ds·k``
   and the rows' ``dK = dsᵀ·Q + Pᵀ·dO`` (P rounded as in the forward), added to dKV.

Roundings are those of the XLA backward: fp32 logits, probabilities and differences, bf16 operands of the four
products with fp32 accumulation, dKV summed in fp32 and rounded once. What differs is the order of the fp32
sums (``Σ p·dp`` by tiles; dKV in atomic order), ~1e-7 relative before the final rounding.

Heads are padded to a multiple of ``HEADS`` (padded heads have zero queries; in the backward their log-sum-exp
is +∞, so they add nothing). The Pallas interpreter (CPU tests) has neither the masked atomic nor a gathered
add that sums repeated rows: there each row is added on its own, the unlisted ones (−1, zero values) into a
dump row past the last entry.

Measured (BENCHMARKS.md, ``configs/small.yaml``'s 16 heads × 256 at 8K queries): on an H200 the forward 1.31 ms
against the Mosaic kernel's 1.57 (with its row lists) and XLA's 3.10; on an H100 the backward 3.45 ms (44.8
TFLOP/s) against XLA's 11.28, 9.78 with Pallas's acquire-release adds. What bounds them: neither the tensor cores
(16-row products) nor HBM (L2 hit rate 99 %, DRAM 0.7 % busy); in the backward the L1TEX latency of the row gathers
at 12 % occupancy (200 registers a thread: the fp32 dQ and row-gradient tiles) and the second pass's recomputation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels import triton_atomics

HEADS = 16  # query heads a program (the smallest M of a Triton dot)
KEYS = 32  # key rows a tile


def _gather(kv_ref, idx_ref, b, s, t, lanes, keys: int):
    """Tile ``t`` of query ``s``'s list: its rows (−1: none), which are listed, and the keys (row 0 where none)."""
    rows = idx_ref[b, s, pl.ds(t * keys, keys)]
    ok = rows >= 0
    return rows, ok, kv_ref[b, jnp.maximum(rows, 0)[:, None], lanes[None, :]]  # [keys, H], gathered by row


def _fwd_kernel(idx_ref, q_ref, sink_ref, kv_ref, o_ref, lse_ref, *, scale: float, keys: int):
    b, s, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hs = pl.ds(hb * HEADS, HEADS)
    q = q_ref[b, s, hs, :]  # [HEADS, H]
    sink = sink_ref[hs]  # [HEADS] fp32
    lanes = jnp.arange(q.shape[-1])

    def tile(t, carry):
        m, den, acc = carry
        _, ok, k = _gather(kv_ref, idx_ref, b, s, t, lanes, keys)
        logits = jnp.where(ok[None, :], jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))  # ≥ the sink: finite
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), k, preferred_element_type=jnp.float32)
        return m_new, den * alpha + jnp.sum(p, axis=1), acc

    init = (sink, jnp.ones_like(sink), jnp.zeros(q.shape, jnp.float32))  # the sink's term: exp(sink − sink)
    m, den, acc = jax.lax.fori_loop(0, idx_ref.shape[-1] // keys, tile, init)
    o_ref[b, s, hs, :] = (acc / den[:, None]).astype(o_ref.dtype)
    lse_ref[b, s, hs] = m + jnp.log(den)


def _bwd_kernel(idx_ref, q_ref, g_ref, lse_ref, kv_ref, dkv_in, dq_ref, delta_ref, dkv_ref, *, scale: float,
            keys: int, dump: int, interpret: bool):
    del dkv_in  # aliased to dkv_ref
    b, s, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hs = pl.ds(hb * HEADS, HEADS)
    q, g = q_ref[b, s, hs, :], g_ref[b, s, hs, :]  # [HEADS, H]
    lse = lse_ref[b, s, hs]  # [HEADS] fp32
    dt = q.dtype
    lanes = jnp.arange(q.shape[-1])
    tiles = idx_ref.shape[-1] // keys

    def rows_of(t):
        rows, ok, k = _gather(kv_ref, idx_ref, b, s, t, lanes, keys)
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        p = jnp.where(ok[None, :], jnp.exp(logits - lse[:, None]), 0.0)  # [HEADS, keys] fp32
        dp = jnp.dot(g, k.T, preferred_element_type=jnp.float32)
        return rows, ok, k, p, dp

    def first(t, delta):
        _, _, _, p, dp = rows_of(t)
        return delta + jnp.sum(p * dp, axis=1)

    delta = jax.lax.fori_loop(0, tiles, first, jnp.zeros(lse.shape, jnp.float32))

    def second(t, dq):
        rows, ok, k, p, dp = rows_of(t)
        ds = (p * (dp - delta[:, None]) * scale).astype(dt)
        dq = dq + jnp.dot(ds, k, preferred_element_type=jnp.float32)
        dk = (jnp.dot(ds.T, q, preferred_element_type=jnp.float32)
              + jnp.dot(p.astype(dt).T, g, preferred_element_type=jnp.float32))  # [keys, H] fp32
        dest = jnp.where(ok, rows, dump)
        if interpret:  # one row an add: the interpreter's gathered add (gather + set) keeps one of a repeated row
            for r in range(keys):
                triton_atomics.add(dkv_ref, (b, pl.ds(dest[r], 1), pl.ds(0, dk.shape[1])), dk[r:r + 1])
        else:
            mask = jnp.broadcast_to(ok[:, None], dk.shape)  # Triton wants the value's shape
            triton_atomics.add(dkv_ref, (b, dest[:, None], lanes[None, :]), dk, mask=mask)
        return dq

    dq = jax.lax.fori_loop(0, tiles, second, jnp.zeros(q.shape, jnp.float32))
    dq_ref[b, s, hs, :] = dq.astype(dq_ref.dtype)
    delta_ref[b, s, hs] = delta


def applies(q: jax.Array, rows: int, keys: int = KEYS) -> bool:
    """Whether these kernels take these queries: a power-of-two head dim in 64..512 (a tile's rows and the
    backward's dKV block in registers) and a row list of whole tiles of ``keys`` rows (a power of two ≥ 16).
    (The model sends them 16-bit activations only; the interpreter takes fp32 too.)"""
    h = q.shape[-1]
    return (h & (h - 1) == 0 and 64 <= h <= 512 and keys & (keys - 1) == 0 and keys >= 16
            and rows % keys == 0)


def _check(q, rows: int, keys: int, name: str) -> None:
    if not applies(q, rows, keys):
        raise ValueError(f"{name}: takes a power-of-two head dim in 64..512 and row lists of whole tiles of a "
                         f"power of two ≥ 16 rows; got queries {q.shape}, {rows} rows and tiles of {keys}")


def _pad_heads(x, pad: int, value=0.0):
    return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3), constant_values=value) if pad else x


@functools.partial(jax.jit, static_argnames=("scale", "keys", "num_warps", "interpret"))
def sparse_mqa(
    q: Float[Array, "B S N H"],
    main: Float[Array, "B T H"],
    extra: Float[Array, "B E H"],
    idx: Int[Array, "B S L"],
    sink: Float[Array, "N"],
    scale: float,
    *,
    keys: int = KEYS,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B S N H"], Float[Array, "B S N"]]:
    """``reference.sparse_mqa``'s ``(out, lse)``: the output in the activation dtype, the log-sum-exp over the keys
    and the sink in fp32."""
    b, s, n, h = q.shape
    _check(q, idx.shape[-1], keys, "sparse_mqa")
    pad = -n % HEADS
    qp = _pad_heads(q, pad)
    sink = jnp.pad(jnp.asarray(sink, jnp.float32), (0, pad))
    kv = jnp.concatenate([main, extra], axis=1).astype(q.dtype)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, keys=keys),
        out_shape=(jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct(qp.shape[:3], jnp.float32)),
        grid=(b, s, (n + pad) // HEADS),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps or (4 if h <= 256 else 8), num_stages=1),
        name="sparse_mqa_fwd",
    )(idx.astype(jnp.int32), qp, sink, kv)
    return out[:, :, :n], lse[:, :, :n]


@functools.partial(jax.jit, static_argnames=("scale", "keys", "num_warps", "interpret"))
def sparse_mqa_bwd(
    q: Float[Array, "B S N H"],
    main: Float[Array, "B T H"],
    extra: Float[Array, "B E H"],
    idx: Int[Array, "B S L"],
    lse: Float[Array, "B S N"],
    g: Float[Array, "B S N H"],
    scale: float,
    *,
    keys: int = KEYS,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B S N H"], Float[Array, "B T H"], Float[Array, "B E H"], Float[Array, "B S N"]]:
    """``(dq, dmain, dextra, Σ_l p_l dp_l)`` of ``reference.sparse_mqa``'s output given its cotangent ``g`` and
    log-sum-exp ``lse``; dq in the activation dtype, dmain / dextra in fp32 (summed over the queries that list
    each row), the last per head for the sink's gradient."""
    b, s, n, h = q.shape
    t, rows = main.shape[1], idx.shape[-1]
    _check(q, rows, keys, "sparse_mqa_bwd")
    pad = -n % HEADS  # padded heads: zero query and cotangent, log-sum-exp +∞ (p = 0)
    q, g, lse = _pad_heads(q, pad), _pad_heads(g, pad), _pad_heads(lse, pad, jnp.inf)
    kv = jnp.concatenate([main, extra], axis=1).astype(q.dtype)
    dump = kv.shape[1]
    dkv = jnp.zeros((b, dump + 1, h), jnp.float32)
    kernel = functools.partial(_bwd_kernel, scale=scale, keys=keys, dump=dump, interpret=interpret)
    # 4 warps at every head dim: on an H100 with relaxed adds, 3.45 ms against 5.71 with 8 at 16 heads x 256,
    # 26.3 against 38.5 ms at 64 heads x 512 (BENCHMARKS.md)
    warps = num_warps or 4
    dq, delta, dkv = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
                   jax.ShapeDtypeStruct(dkv.shape, jnp.float32)),
        grid=(b, s, (n + pad) // HEADS),
        input_output_aliases={5: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        name="sparse_mqa_bwd",
    )(idx.astype(jnp.int32), q, g.astype(q.dtype), lse.astype(jnp.float32), kv, dkv)
    return dq[:, :, :n], dkv[:, :t], dkv[:, t:dump], delta[:, :, :n]
