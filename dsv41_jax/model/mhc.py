"""Single-Pass mHC: coefficient prediction, Sinkhorn, collapse and expand (spec model §4).

The residual is ``M`` streams ``X [B, S, M, D]`` kept in the activation dtype between sublayers; all
mixing math is fp32. Each site (attention, FFN) predicts post/comb for itself and ``pre`` for the *next*
site (single-pass schedule, spec model §4.4).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Float

from dsv41_jax.config import MHCConfig
from dsv41_jax.model.layers import normal
from dsv41_jax.sharding import param


def sinkhorn(logits: Float[Array, "*B M M"], iters: int, eps: float, unroll: bool = False) -> Float[Array, "*B M M"]:
    """Row-softmax, then column/row normalisations; 20 of each for iters=20, ending on columns (§4.2).

    The iterations are a ``fori_loop``: one copy of the normalisations in the program. ``unroll`` writes the
    38 normalisations out instead. On GPU each trip of a loop is launched from the host (it is not part of the
    step's CUDA graph), ~30 µs a trip where the matrices are few, so at decode (19 trips a site, two sites a
    layer) the loops were most of a step's kernels; unrolled, XLA fuses a site into one kernel (one site on an
    H100, ``benchmarks/mhc_bench.py``: 642 → 81 µs; the engine-bench decode step 30.2 → 25.4 ms). The price is
    compile time (that decode step: 32 → 135 s), so :func:`hc_mixes` unrolls only on GPU and only up to
    ``MHCConfig.sinkhorn_unroll_rows`` matrices; training and prefill batches keep the loop, whose kernels
    outlast its launches, and so do CPU and TPU, whose loops need no launch a trip. Same arithmetic either way.
    """
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, c, unroll=True if unroll else 1)


def hc_params(cfg: MHCConfig, dim: int, rngs: nnx.Rngs) -> tuple[nnx.Param, nnx.Param, nnx.Param]:
    """One site's ``hc_{site}_fn [(2+M)·M, M·D]``, ``_base [(2+M)·M]``, ``_scale [3]`` (fp32).

    Initialisation is not disclosed (spec model §4.5 [OPEN]): fn ~ N(0, 0.02), base 0, scale 1, which
    starts with pre ≈ 0.5, post ≈ 1 and comb ≈ uniform.
    """
    m = cfg.hc_mult
    return (param("hc_fn", normal(rngs, ((2 + m) * m, m * dim), 0.02, jnp.float32)),
            param("hc_vector", jnp.zeros(((2 + m) * m,), jnp.float32)),
            param("hc_vector", jnp.ones((3,), jnp.float32)))


# On GPU collapse and expand are written out as sums over the M streams, so that XLA fuses each into one
# elementwise kernel. As products, XLA:GPU ran expand as a GEMM kernel plus an add (one decode site on an H100,
# benchmarks/decode_forms.py: 27.2 -> 17.4 µs at batch 1, 27.8 -> 22.3 µs at batch 32), and at training rows
# as batched fp32 GEMMs of M-wide matrices (a block's two sites at 8,192 rows on an H200, the program of
# `benchmarks/mhc_bench.py --site`, BENCHMARKS.md: forward 942 -> 613 µs, forward + backward 4,386 -> 3,851 µs).
# CPU and TPU keep the products:
# on XLA:CPU (jax 0.10.2) the written-out forms reach its YNNPACK fusions, which computed training steps and
# sharded forwards wrong (the same tests pass with --xla_cpu_experimental_ynn_fusion_type=); on TPU they are
# unmeasured.


def _written_out(x: jax.Array) -> bool:
    del x  # every row count on GPU
    return jax.default_backend() == "gpu"


def hc_mixes(x: Float[Array, "B S M D"], fn: ArrayLike, base: ArrayLike, scale: ArrayLike, cfg: MHCConfig,
             norm_eps: float):
    """Returns ``(pre [B,S,M], post [B,S,M], comb [B,S,M,M])`` in fp32 (spec model §4.2)."""
    return coefficients(mix_logits(x, fn, norm_eps), base, scale, cfg)


def mix_logits(x: Float[Array, "B S M D"], fn: ArrayLike, norm_eps: float) -> Float[Array, "B S Y"]:
    """``RMS-normalised flat(X) · fnᵀ`` in fp32: the (2+M)·M raw mixes of a site."""
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)  # [B, S, M·D], stream-major
    r = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    # a product, also where collapse and expand are written out: as a multiply and a sum over [B, S, 1, M·D] ×
    # [Y, M·D], XLA:CPU (jax 0.10.2) fused it into a YNNPACK kernel that returned wrong sums for S ≥ 8
    return jnp.einsum("bsx,yx->bsy", flat, fn, precision="highest") * r


def coefficients(mix: Float[Array, "B S Y"], base: ArrayLike, scale: ArrayLike, cfg: MHCConfig):
    """``(pre, post, comb)`` from a site's raw mixes: the sigmoids and the Sinkhorn of comb."""
    m, eps = cfg.hc_mult, cfg.hc_eps
    pre = jax.nn.sigmoid(mix[..., :m] * scale[0] + base[:m]) + eps
    post = 2 * jax.nn.sigmoid(mix[..., m:2 * m] * scale[1] + base[m:2 * m])
    comb = (mix[..., 2 * m:] * scale[2] + base[2 * m:]).reshape(*mix.shape[:-1], m, m)
    unroll = jax.default_backend() == "gpu" and math.prod(comb.shape[:-2]) <= cfg.sinkhorn_unroll_rows
    return pre, post, sinkhorn(comb, cfg.hc_sinkhorn_iters, eps, unroll=unroll)


def collapse(x: Float[Array, "B S M D"], pre: Float[Array, "B S M"]) -> Float[Array, "B S D"]:
    """``u = Σ_c pre_c · X_c`` in fp32, cast to the stream dtype (spec model §4.3)."""
    xf = x.astype(jnp.float32)
    if _written_out(x):
        u = functools.reduce(jnp.add, [pre[..., c, None] * xf[..., c, :] for c in range(x.shape[-2])])
    else:
        u = jnp.einsum("bsm,bsmd->bsd", pre, xf, precision="highest")
    return u.astype(x.dtype)


def expand(
    f: Float[Array, "B S D"], residual: Float[Array, "B S M D"], post: Float[Array, "B S M"],
    comb: Float[Array, "B S M M"],
) -> Float[Array, "B S M D"]:
    """``X'_j = post_j·F + Σ_i comb[i, j]·R_i`` (row i = source stream, column j = destination)."""
    r, ff = residual.astype(jnp.float32), f.astype(jnp.float32)
    m = residual.shape[-2]
    if _written_out(residual):
        out = jnp.stack([functools.reduce(jnp.add, [post[..., j, None] * ff]
                                          + [comb[..., i, j, None] * r[..., i, :] for i in range(m)])
                         for j in range(m)], axis=-2)
    else:
        out = post[..., None] * ff[:, :, None, :] + jnp.einsum("bsmM,bsmd->bsMd", comb, r, precision="highest")
    return out.astype(residual.dtype)
