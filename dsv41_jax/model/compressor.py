"""The CSA2 compressor of KV-source layers: one RoPE-free latent per complete group of m tokens (spec §3.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from dsv41_jax.model.layers import Linear, RMSNorm


class Compressor(nnx.Module):
    """m = 1: ``RMSNorm(x·Wkvᵀ)``. m = 2: per-channel softmax pooling of each group's two tokens, in fp32,
    then a cast to the activation dtype and RMSNorm. No overlap, no position bias; a trailing partial group
    yields no entry."""

    def __init__(self, dim: int, head_dim: int, ratio: int, norm_eps: float, *, dtype, param_dtype,
                 rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wkv = Linear(dim, head_dim, "kv_down", **kw)
        if ratio > 1:
            self.wgate = Linear(dim, head_dim, "kv_down", **kw)
        self.norm = RMSNorm(head_dim, norm_eps, param_dtype=param_dtype)
        self.ratio = ratio

    def __call__(self, x: Float[Array, "B S D"]) -> Float[Array, "B C H"]:
        m = self.ratio
        if m == 1:
            return self.norm(self.wkv(x))
        b, s, _ = x.shape
        t = s // m
        xg = x[:, : t * m].astype(jnp.float32)
        c = self.wkv(xg, dtype=jnp.float32).reshape(b, t, m, -1)
        z = self.wgate(xg, dtype=jnp.float32).reshape(b, t, m, -1)
        pooled = (jax.nn.softmax(z, axis=2) * c).sum(axis=2)  # [B, C, H]
        return self.norm(pooled.astype(x.dtype))
