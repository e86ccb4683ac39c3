"""Small building blocks: the model's mixed-precision product, linear layers in the checkpoint's [out, in] layout
and RMSNorm."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, ArrayLike, Float

from dsv41_jax import quant
from dsv41_jax.sharding import param


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    """N(0, std²) initial values from the module's ``params`` stream.

    Traced construction (jit, eval_shape, sharded init) draws with ``jax.random``. Eager construction
    draws with NumPy's generator seeded by the same per-parameter key: compiling one threefry program
    per parameter shape costs ~0.6 s each on a CPU, which would dominate small-model start-up. The two
    paths give different (equally distributed) values for the same seed.
    """
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return jnp.asarray(std * np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


MATMUL = "matmul"  # checkpoint name of :func:`mixed_einsum`'s outputs: remat "dots" keeps them


def mixed_einsum(spec: str, a: ArrayLike, b: ArrayLike) -> Float[Array, "..."]:
    """``einsum(spec, a, b)`` accumulated and returned in fp32; with bf16 (or f16) operands, its gradients are
    computed in the operands' dtype.

    Autodiff would transpose the product against its fp32 cotangent: an fp32 × bf16 product, which promotes
    to fp32 (a TF32 or fp32 GEMM on GPU, at half the bf16 rate or less, with twice the bytes). Here the
    cotangent is rounded to the operands' dtype first and the two transposed products run in that dtype with
    fp32 accumulation, each result rounded once to the operand's dtype (what autodiff returns for a bf16
    operand too). Where the cotangent arrives from a bf16 value (a product cast to bf16, as in
    :class:`Linear`), that rounding is exact and the gradients are those of autodiff; where it is an fp32
    value (the attention's logits and P·V, the experts' activations), it rounds as a bf16 backward does.
    Operands of fp32, or of two dtypes, take the plain product and autodiff.
    """
    if gradient_dtype(a, b) != jnp.float32:
        out = _low_precision_einsum(spec, a, b)
    else:
        out = jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return checkpoint_name(out, MATMUL)


def gradient_dtype(a: ArrayLike, b: ArrayLike) -> jnp.dtype:
    """The dtype a product's backward runs in: the operands' when both are one dtype narrower than fp32
    (bf16, f16), else fp32 (:func:`mixed_einsum`, the grouped matmul's rule)."""
    if a.dtype == b.dtype and jnp.dtype(a.dtype).itemsize < 4:
        return jnp.dtype(a.dtype)
    return jnp.dtype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _low_precision_einsum(spec: str, a: Array, b: Array) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _low_precision_fwd(spec, a, b):
    return _low_precision_einsum(spec, a, b), (a, b)


def _low_precision_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda a_, b_: jnp.einsum(spec, a_, b_, preferred_element_type=a.dtype), a, b)
    return vjp(g.astype(a.dtype))


_low_precision_einsum.defvjp(_low_precision_fwd, _low_precision_bwd)


# From this many rows the GPU's head splits x into bf16 terms (:func:`fp32_head`). One H100, the 129,280 × 2048
# bf16 head (BENCHMARKS.md): fp32 product 323.6 µs at 1 row and 1,242.6 µs at 32; the split 378.2 and 494.0 µs.
# Linear between the two the forms cross near 3 rows.
HEAD_SPLIT_MIN_ROWS = 4


def fp32_head(x: Float[Array, "*B D"], w: ArrayLike, *, split: bool | None = None) -> Float[Array, "*B V"]:
    """``x · wᵀ`` for fp32 ``x`` and a [V, D] weight, as the fp32 product the spec asks of the output head.

    With a bf16 weight on GPU from :data:`HEAD_SPLIT_MIN_ROWS` rows (``split`` None: decided so), ``x`` is
    split into three bf16 terms (``x = x₁ + x₂ + x₃`` to 24 bits, each the rounding of what the previous left,
    by ``reduce_precision``: a bf16 cast round trip inside one program may be removed by XLA:GPU) and the
    three products run as one bf16 matmul of three times the rows, fp32 accumulation: each bf16 × bf16
    product is exact in fp32, so the result is the fp32 product to summation order, and the weight is read
    once, as bf16. XLA:GPU's fp32 matmul at precision ``highest`` read it at 0.43 TB/s at 32 rows (2.5× the
    split's time); at one row it is the faster form. The gradient is the fp32 product's. Elsewhere, or with
    an fp32 weight, the plain fp32 product.
    """
    w = jnp.asarray(w)
    x = x.astype(jnp.float32)
    if split is None:
        split = jax.default_backend() == "gpu" and math.prod(x.shape[:-1]) >= HEAD_SPLIT_MIN_ROWS
    if not split or w.dtype != jnp.bfloat16:
        return jnp.einsum("...d,vd->...v", x, w.astype(jnp.float32), precision="highest")
    return _split_head(x, w)


@jax.custom_vjp
def _split_head(x, w):
    terms, rest = [], x
    for _ in range(3):
        t = jax.lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
        terms.append(t.astype(jnp.bfloat16))
        rest = rest - t
    y = jnp.einsum("t...d,vd->t...v", jnp.stack(terms), w, preferred_element_type=jnp.float32)
    return y[2] + y[1] + y[0]  # smallest first


def _split_head_fwd(x, w):
    return _split_head(x, w), (x, w)


def _split_head_bwd(res, g):  # the fp32 product's gradients (reduce_precision has no useful derivative here)
    x, w = res
    dx = jnp.einsum("...v,vd->...d", g, w.astype(jnp.float32), precision="highest")
    dw = jnp.einsum("...v,...d->vd", g, x, precision="highest")
    return dx, dw.astype(w.dtype)


_split_head.defvjp(_split_head_fwd, _split_head_bwd)


class Linear(nnx.Module):
    """``y = x · Wᵀ`` with ``W`` stored [out, in] like the checkpoint; computed in ``dtype``.

    ``native=True`` holds the release's own storage (spec model §2.2): ``weight`` float8_e4m3fn [out, in] and
    ``scale`` [out/32, in/32] as raw E8M0 bytes (uint8), dequantised on the fly. The dequantised values are
    exact in fp32 and bf16, so the product equals the float path on a dequantising conversion.
    """

    def __init__(self, d_in: int, d_out: int, role: str, *, dtype, param_dtype, rngs: nnx.Rngs,
                 native: bool = False):
        w = normal(rngs, (d_out, d_in), d_in ** -0.5, jnp.float32 if native else param_dtype)
        if native:
            w, scale = quant.quantize_fp8_blocks(w)
            self.scale = param(role, scale)
        self.weight = param(role, w)
        self.dtype, self.native = dtype, native

    def dense(self, dtype) -> Float[Array, "Y X"]:
        """The weight as a ``dtype`` matrix (dequantised from FP8 + E8M0 blocks when native)."""
        if self.native:
            return quant.dequant_fp8_blocks(self.weight[...], self.scale[...]).astype(dtype)
        return jnp.asarray(self.weight[...], dtype)  # a converted model may hold NumPy values

    def __call__(self, x: Float[Array, "*B X"], dtype=None) -> Float[Array, "*B Y"]:
        dt = dtype or self.dtype
        return mixed_einsum("...x,yx->...y", x.astype(dt), self.dense(dt)).astype(dt)


class RMSNorm(nnx.Module):
    """``w ⊙ x·rsqrt(mean(x²) + eps)`` with fp32 statistics, cast back to the input dtype (spec model §3.1)."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = param("norm", jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "*B D"]) -> Float[Array, "*B D"]:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)
