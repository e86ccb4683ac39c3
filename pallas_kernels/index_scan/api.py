"""index_scan: the KV source's full index scan over its packed MXFP4 keys (spec attention §3.5), on the backend
``attention.kernel_backend`` names. :meth:`dsv41_jax.cache.PackedKV.index_scores` calls it.

``backend="xla"`` is the reference (``reference.py``). ``backend="pallas"`` on a GPU runs the Triton kernel
(``triton.py``) for calls of at most ``MAX_QUERIES`` query rows per sequence with 16-bit queries: decode and
speculative verification, where the scan reads every key once per query row and the XLA path's unpacked keys
and per-head products dominate. Prefill chunks (thousands of rows: one large matmul), fp32 models, CPU and TPU
unpack the keys with the backend's unpack kernel (``fp4_pack``) and score them as the reference does; the
kernel's numerics are tested on CPU in the Pallas interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from dsv41_jax.model.indexer import index_scores as dense_index_scores
from pallas_kernels import fp4_pack
from pallas_kernels.index_scan import reference, triton

BACKENDS = ("xla", "pallas")
# query rows per sequence up to which the kernel runs: each re-reads the keys (from L2 when they fit)
MAX_QUERIES = 16
# whether backend="pallas" takes the kernel on GPU. On the H200 at batch 1 (BENCHMARKS.md): 19.5 µs against XLA's
# 80 at 131,072 keys, 64 against 316 at 524,288, even at 2,048 (7 µs, launch-bound); larger batches not yet timed
GPU_KERNEL = True


def kernel_applies(iq) -> bool:
    return (GPU_KERNEL and jax.default_backend() == "gpu" and iq.shape[1] <= MAX_QUERIES
            and jnp.dtype(iq.dtype).itemsize == 2)


def index_scores(iq: Float[Array, "B S N I"], w: Float[Array, "B S N"], codes: UInt8[Array, "B T P"],
                 exps: UInt8[Array, "B T G"], *, backend: str = "xla") -> Float[Array, "B S T"]:
    """``Σ_h w[s, h]·ReLU(q[s, h]·k[t])`` for every packed key ``t`` (fp32, nothing masked)."""
    if backend not in BACKENDS:
        raise ValueError(f"index_scan: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return reference.index_scores(iq, w, codes, exps)
    if kernel_applies(iq):
        return triton.index_scores(iq, w, codes, exps)
    # every key unpacked by the backend's unpack kernel, then the reference's score
    return dense_index_scores(iq, w, fp4_pack.unpack_mxfp4(codes, exps, iq.dtype, backend=backend))
