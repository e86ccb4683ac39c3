"""The index scan as one Pallas (Triton) kernel for GPU: packed MXFP4 keys in, fp32 scores out.

At decode a KV source scores every entry it holds: ``I[s, t] = Σ_h w[s, h]·ReLU(q[s, h]·k[t])`` (spec attention
§3.5). In XLA that is an unpack of every key to bf16 (written to HBM and read back), a [N, T] fp32 matmul result
per query (written and read back again) and the weighted head sum: at batch 32 and 65,536 entries ~8× the
68 bytes a key is stored in. No library kernel decodes MXFP4 operands (E2M1 nibbles, one E8M0 byte per 32
lanes) inside a matmul whose output is reduced over its rows, hence this one.

Each program takes one query (its N heads, padded to ≥ 16 rows for the tensor cores) and ``block`` entries.
A key's 128 lanes are 4 groups of 32, stored as 16 bytes of nibble pairs (low nibble = even lane) and one
scale byte. Instead of interleaving the decoded nibbles back into lane order, the query is split into its even
and odd lanes (in XLA, once a call) and each group contributes two products of 16 lanes: ``q_even·k_evenᵀ``
and ``q_oddᵀ·k_oddᵀ``. Decoded values are ``E2M1 · 2^e`` in fp32, exact in bf16, so the products are the
reference's bf16 × bf16 products with fp32 accumulation; only the order of the fp32 sums differs (within fp32
rounding of the XLA path). Bytes read: 68 per entry per query row of the cache; written: 4 (the score).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, UInt8

from pallas_kernels.fp4_pack.decode import e2m1_value, e8m0_value

GROUP = 32  # MXFP4 lanes per scale byte (spec attention §7.3)
MIN_ROWS = 16  # the smallest M of a bf16 tensor-core product
DEFAULT_BLOCK = 128


def _kernel(qe_ref, qo_ref, w_ref, codes_ref, exps_ref, out_ref, *, block: int, groups: int, entries: int):
    b, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = j * block
    ok = start + jnp.arange(block) < entries  # the last block may run past the cache
    rows = pl.ds(start, block)
    half = GROUP // 2
    acc = None
    for g in range(groups):
        lanes = pl.ds(g * half, half)
        c = plt.load(codes_ref.at[b, rows, lanes], mask=ok[:, None], other=0).astype(jnp.int32)  # [block, 16]
        scale = e8m0_value(plt.load(exps_ref.at[b, rows, pl.ds(g, 1)], mask=ok[:, None], other=127)
                           .astype(jnp.int32))  # [block, 1]
        even = (e2m1_value(c & 0xF) * scale).astype(qe_ref.dtype)  # exact: E2M1 times a power of two
        odd = (e2m1_value(c >> 4) * scale).astype(qe_ref.dtype)
        part = (jnp.dot(qe_ref[b, s, :, lanes], even.T, preferred_element_type=jnp.float32)
                + jnp.dot(qo_ref[b, s, :, lanes], odd.T, preferred_element_type=jnp.float32))
        acc = part if acc is None else acc + part
    score = jnp.sum(w_ref[b, s, :][:, None] * jnp.maximum(acc, 0.0), axis=0)  # [block]
    plt.store(out_ref.at[b, s, rows], score, mask=ok)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def index_scores(iq: Float[Array, "B S N I"], w: Float[Array, "B S N"], codes: UInt8[Array, "B T P"],
                 exps: UInt8[Array, "B T G"], *, block: int = DEFAULT_BLOCK, interpret: bool = False
                 ) -> Float[Array, "B S T"]:
    """:func:`pallas_kernels.index_scan.reference.index_scores` in one kernel. The keys are decoded to the queries'
    dtype: bf16 or f16 on GPU (``api`` dispatches only those; an fp32 product there would run as TF32), fp32 too
    in the interpreter. ``interpret`` runs it in the Pallas interpreter (CPU tests)."""
    b, s, n, i = iq.shape
    t = codes.shape[1]
    groups = i // GROUP
    if i % GROUP or codes.shape != (b, t, i // 2) or exps.shape != (b, t, groups) or w.shape != (b, s, n):
        raise ValueError(f"index_scan: queries {iq.shape}, weights {w.shape}, codes {codes.shape} and exps "
                         f"{exps.shape} do not describe [B, S, N, I] queries over [B, T, I/2] + [B, T, I/32] keys")
    if block & (block - 1) or block < 16:
        raise ValueError(f"index_scan: block must be a power of two >= 16, got {block}")
    rows = max(MIN_ROWS, 1 << (n - 1).bit_length())  # zero heads with zero weight add nothing
    iq = jnp.pad(iq, ((0, 0), (0, 0), (0, rows - n), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, 0), (0, rows - n)))
    kernel = functools.partial(_kernel, block=block, groups=groups, entries=t)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, s, t), jnp.float32),
        grid=(b, s, pl.cdiv(t, block)),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        name="index_scan",
    )(iq[..., 0::2], iq[..., 1::2], w, codes, exps)
