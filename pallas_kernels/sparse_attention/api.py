"""sparse_attention: the model's attention core (spec attention §3.6) on the backend ``attention.kernel_backend``
names; :class:`~dsv41_jax.model.attention.Attention` calls it, once.

``backend="xla"`` is the reference, :func:`dsv41_jax.model.sparse.sparse_attention`. ``backend="pallas"`` on a
GPU rewrites the arguments into two key arrays and a row list per query (``layout.key_rows``) and runs a kernel
forward: for fewer than 64 heads the Triton one (``triton_mqa.sparse_mqa``, 16 heads a program;
``TRITON_FORWARD``), else the Mosaic GPU one (``mosaic.sparse_mqa``, 64 heads a CTA). Its gradient
(:func:`sparse_mqa`'s VJP) is computed from the forward's log-sum-exp, without a second softmax pass: below 64
heads in one Triton kernel (``triton_mqa.sparse_mqa_bwd``, dKV by fp32 atomics; ``TRITON_BACKWARD``), else in
XLA (dQ, dKV summed into the key rows in fp32: an entry is read by many queries), and the sink's gradient.
Where no kernel applies it falls back to the reference: the indexer's probability mass (``return_mass``), head
dims the kernels do not take (a multiple of 64 up to 512), fp32 activations and calls too small to fill the GPU
(``MIN_CTAS``); and the CPU. On TPU ``backend="pallas"`` runs ``tpu.sparse_mqa`` (Mosaic TPU; numerics checked
in the interpreter, not yet run on
a TPU) forward and ``tpu.sparse_mqa_bwd`` backward, the same formula as the XLA one.

Decode steps can skip the unpacked keys altogether: :func:`sparse_decode` (``packed_decode.py``, Triton) reads
the SWA ring and the picked rows in their cache formats; the engine's store calls it
(:meth:`dsv41_jax.cache.PackedKV.packed_attention`) where :func:`packed_decode_applies`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dsv41_jax.model import sparse as xla
from pallas_kernels.sparse_attention import layout, mosaic, packed_decode, tpu, triton_mqa

BACKENDS = ("xla", "pallas")


def sparse_attention(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array | np.ndarray, "N"],
    window: int,
    compressed_kv: Float[Array, "B T H"] | None = None,
    topk: Int[Array, "B S K"] | None = None,
    replay_start: int | Int[Array, ""] | Int[Array, "B"] = 0,
    *,
    start: Int[Array, "B"] | None = None,
    prefix_kv: Float[Array, "B P H"] | None = None,
    prefix_pos: Int[Array, "B P"] | None = None,
    picked: Float[Array, "B S K H"] | None = None,
    key_floor: Int[Array, "B S"] | None = None,
    return_mass: bool = False,
    causal: bool = True,
    backend: str = "xla",
):
    """:func:`dsv41_jax.model.sparse.sparse_attention` (same arguments and result) on ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"sparse_attention: backend must be one of {BACKENDS}, got {backend!r}")
    kw = dict(start=start, prefix_kv=prefix_kv, prefix_pos=prefix_pos, picked=picked, key_floor=key_floor)
    if backend == "xla" or return_mass or not causal or not kernel_applies(q):  # draft blocks: XLA (5 rows)
        return xla.sparse_attention(q, window_kv, sink, window, compressed_kv, topk, replay_start,
                                    return_mass=return_mass, causal=causal, **kw)
    main, extra, idx = layout.key_rows(window_kv, window, compressed_kv, topk, replay_start, dtype=q.dtype, **kw)
    return sparse_mqa(q, main, extra, idx, sink, q.shape[-1] ** -0.5, False, kernel_platform(q, idx.shape[-1]))


# The kernel runs a CTA per query and group of 64 heads: below this many the GPU is mostly idle, and on the
# H200 the XLA path was faster (decode at batch 1 and 32: 47 / 59 µs against 19 / 49 µs; at batch 128 the
# kernel was 95 µs against 157 µs; BENCHMARKS.md). Split-key decode is what would lift this floor.
MIN_CTAS = 64


def kernel_applies(q: jax.Array) -> bool:
    """Whether a kernel takes this query: on TPU the Mosaic TPU kernel always; on GPU the Mosaic GPU kernel for
    its dtypes and head dims where it is the faster path (at least ``MIN_CTAS`` CTAs of work)."""
    b, s, n, h = q.shape
    if jax.default_backend() == "tpu":
        return True
    return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and h % mosaic.TILE[1] == 0 and h <= 2 * mosaic.MAX_CHUNK
            and b * s * -(-n // mosaic.HEADS) >= MIN_CTAS)


_KERNELS = {"gpu": mosaic.sparse_mqa, "triton": triton_mqa.sparse_mqa, "tpu": tpu.sparse_mqa}

# whether queries of fewer heads than the Mosaic kernel's 64-row tile take the Triton forward (``triton_mqa``,
# 16 heads a program) on GPU, rather than the Mosaic kernel, which pads them to 64 rows. On the H200 at
# configs/small.yaml's 16 heads x 256, 8K queries: 1.31 ms against 1.57 (BENCHMARKS.md)
TRITON_FORWARD = True


def kernel_platform(q: jax.Array, rows: int) -> str:
    """Which kernel :func:`sparse_mqa` runs for queries that :func:`kernel_applies` to: ``"tpu"``; on GPU
    ``"triton"`` for fewer than 64 heads with ``TRITON_FORWARD``, else ``"gpu"`` (Mosaic)."""
    backend = jax.default_backend()
    if backend == "gpu" and TRITON_FORWARD and q.shape[2] < mosaic.HEADS and triton_mqa.applies(q, rows):
        return "triton"
    return backend

# whether the GPU backward of fewer than 64 heads runs ``triton_mqa.sparse_mqa_bwd`` (dQ and dKV in one kernel,
# the row gradients added into dKV by relaxed fp32 atomics) instead of XLA's gather + per-query products + fp32
# scatter. On an H100 at configs/small.yaml's 16 heads x 256, 8K queries: 3.45 ms against 11.28 (BENCHMARKS.md).
# At 64 heads x 512 (four head blocks adding into dKV each) it took 26.3 ms against XLA's 25.7, so the XLA
# backward stays there
TRITON_BACKWARD = True


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def sparse_mqa(q: Float[Array, "B S N H"], main: Float[Array, "B T H"], extra: Float[Array, "B E H"],
               idx: Int[Array, "B S L"], sink: Float[Array | np.ndarray, "N"], scale: float, interpret: bool = False,
               platform: str = "gpu") -> Float[Array, "B S N H"]:
    """The output of ``platform``'s kernel (``reference.sparse_mqa`` without the log-sum-exp), differentiable;
    ``platform`` is ``"gpu"`` (Mosaic GPU), ``"triton"`` or ``"tpu"``; ``interpret`` runs it in the Pallas
    interpreter (CPU tests)."""
    return _KERNELS[platform](q, main, extra, idx, sink, scale, interpret=interpret)[0]


def _fwd(q, main, extra, idx, sink, scale, interpret, platform):
    out, lse = _KERNELS[platform](q, main, extra, idx, sink, scale, interpret=interpret)
    return out, (q, main, extra, idx, sink, lse)


def _bwd(scale, interpret, platform, res, g):
    """Flash-attention backward over the row lists, from the forward's log-sum-exp (spec §3.6's softmax with
    the sink: p_sink = exp(sink − lse), and its value is zero, so d sink = −Σ p_sink · Σ_l p_l dp_l). On GPU,
    below 64 heads with ``TRITON_BACKWARD``, one Triton kernel gives dQ, dKV and Σ p·dp (``triton_mqa``);
    otherwise each query's dQ, row gradients and Σ p·dp come from the Mosaic TPU kernel on TPU, else from XLA,
    and the row gradients are then summed into the key arrays in fp32 (an entry is read by many queries)."""
    q, main, extra, idx, sink, lse = res
    t = main.shape[1]
    if (platform in ("gpu", "triton") and TRITON_BACKWARD and q.shape[2] < mosaic.HEADS
            and triton_mqa.applies(q, idx.shape[-1])):
        dq, dmain, dextra, delta = triton_mqa.sparse_mqa_bwd(q, main, extra, idx, lse, g, scale, interpret=interpret)
        dsink = -(jnp.exp(sink.astype(jnp.float32) - lse) * delta).sum((0, 1))
        return dq, dmain.astype(main.dtype), dextra.astype(extra.dtype), None, dsink.astype(sink.dtype)
    if platform == "tpu":
        dq, dkeys, delta = tpu.sparse_mqa_bwd(q, main, extra, idx, lse, g, scale, interpret=interpret)
    else:
        dq, dkeys, delta = _query_grads(q, main, extra, idx, lse, g, scale)

    def rows_of(kv, rows):  # fp32 sums into the rows of one key array; other rows are dropped (past the end)
        return jax.vmap(lambda i, d: jnp.zeros(kv.shape[1:], jnp.float32).at[i].add(d, mode="drop"))(
            jnp.where(rows >= 0, rows, kv.shape[1]), dkeys).astype(kv.dtype)

    dmain = rows_of(main, jnp.where(idx < t, idx, -1))
    dextra = rows_of(extra, jnp.where(idx >= t, idx - t, -1))
    dsink = -(jnp.exp(sink.astype(jnp.float32) - lse) * delta).sum((0, 1))
    return dq.astype(q.dtype), dmain, dextra, None, dsink.astype(sink.dtype)


def _query_grads(q, main, extra, idx, lse, g, scale):
    """``(dq, dkeys [B, S, L, H] fp32, Σ_l p_l dp_l [B, S, N])`` in XLA: ``tpu.sparse_mqa_bwd``'s result."""
    dt = q.dtype
    keys = xla.gather_entries(jnp.concatenate([main, extra], axis=1).astype(dt), jnp.maximum(idx, 0))
    logits = jnp.einsum("bsnh,bslh->bsnl", q, keys, preferred_element_type=jnp.float32) * scale
    p = jnp.where((idx >= 0)[:, :, None, :], jnp.exp(logits - lse[..., None]), 0.0)  # [B, S, N, L] fp32
    g = g.astype(dt)
    dp = jnp.einsum("bsnh,bslh->bsnl", g, keys, preferred_element_type=jnp.float32)
    # Σ_l p_l dp_l from the probabilities themselves, not dO·O: O was rounded to the activation dtype, and
    # dp − delta cancels where one key dominates. The difference is taken in fp32 and only then rounded for
    # the products (bf16 matmuls; fp32 ds made them fp32 matmuls, 10% slower in all on the H200)
    delta = (p * dp).sum(-1)  # [B, S, N]
    ds = (p * (dp - delta[..., None]) * scale).astype(dt)
    dq = jnp.einsum("bsnl,bslh->bsnh", ds, keys, preferred_element_type=jnp.float32)
    # K = V: a key row's gradient is dSᵀ·Q + Pᵀ·dO, one product over the heads of both ([dS | P] · [Q | dO]):
    # two products and an fp32 add of [B, S, L, H] each way would write and re-read that sum three times
    dkeys = jnp.einsum("bsnl,bsnh->bslh", jnp.concatenate([ds, p.astype(dt)], axis=2),
                       jnp.concatenate([q, g], axis=2), preferred_element_type=jnp.float32)
    return dq, dkeys, delta


sparse_mqa.defvjp(_fwd, _bwd)


# whether backend="pallas" takes the packed decode kernel on GPU: off. Its first form was slower on the H200 than
# the XLA path it would replace (batch 1: 33–41 µs against 22; batch 32: 170–515 against 74; BENCHMARKS.md): byte
# loads a lane. The present form (32-bit word loads, 8 lane phases) is tested in the interpreter, not yet timed
PACKED_DECODE = False


def packed_decode_applies(q: jax.Array, backend: str) -> bool:
    """Whether ``backend`` runs a one-token chunk's attention straight from the packed caches
    (:func:`packed_decode.sparse_decode`): ``pallas`` on a GPU with ``PACKED_DECODE``, 16-bit activations, head
    blocks of 16."""
    b, s, n, h = q.shape
    return (PACKED_DECODE and backend == "pallas" and jax.default_backend() == "gpu" and s == 1
            and q.dtype in (jnp.bfloat16, jnp.float16) and n % 16 == 0 and h % 64 == 0)


def sparse_decode(q, own_kv, sink, window: int, ring_values, ring_exps, ring_pos, kv_codes, kv_scales, topk, start,
                  floor) -> Float[Array, "B 1 N H"]:
    """:func:`packed_decode.sparse_decode` in its default variant (16 heads a program, key tiles of 32, 4 warps:
    not yet tuned on a GPU; ``bench_packed.py`` times the others)."""
    floor = jnp.broadcast_to(jnp.asarray(floor, jnp.int32), start.shape)
    return packed_decode.sparse_decode(q, own_kv, jnp.asarray(sink), window, ring_values, ring_exps, ring_pos, kv_codes,
                                       kv_scales, topk, start, floor)
