"""Small building blocks: linear layers in the checkpoint's [out, in] layout and RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

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
        return jnp.einsum("...x,yx->...y", x.astype(dt), self.dense(dt),
                          preferred_element_type=jnp.float32).astype(dt)


class RMSNorm(nnx.Module):
    """``w ⊙ x·rsqrt(mean(x²) + eps)`` with fp32 statistics, cast back to the input dtype (spec model §3.1)."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = param("norm", jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "*B D"]) -> Float[Array, "*B D"]:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)
