"""The CSA2 compressor of KV-source layers: one RoPE-free latent per complete group of m tokens (spec §3.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

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

    def __call__(self, x: Float[Array, "B S D"], first: Int[Array, "B C"] | None = None) -> Float[Array, "B C H"]:
        """Latents of the complete groups of a sequence that starts at position 0.

        ``first`` (packed documents, :mod:`dsv41_jax.model.documents`) gives the row of each group's first
        token instead: groups then follow document boundaries rather than ``j·m`` of the row.
        """
        m = self.ratio
        if m == 1:  # every token is a group of its own, whatever the documents
            return self.norm(self.wkv(x))
        b, s, _ = x.shape
        if first is not None:
            c, z = self.project(x)
            rows = (first[..., None] + jnp.arange(m)).reshape(b, -1, 1)  # [B, C·m, 1]
            group = lambda v: jnp.take_along_axis(v, rows, axis=1).reshape(b, -1, m, v.shape[-1])
            return self.pool(group(c), group(z), x.dtype)
        t = s // m
        c, z = self.project(x[:, : t * m])
        return self.pool(c.reshape(b, t, m, -1), z.reshape(b, t, m, -1), x.dtype)

    def project(self, x: Float[Array, "*B D"]) -> tuple[Float[Array, "*B H"], Float[Array, "*B H"]]:
        """Per-token fp32 values ``c = x·Wkvᵀ`` and gate logits ``z = x·Wgateᵀ`` (ratio > 1)."""
        xf = x.astype(jnp.float32)
        return self.wkv(xf, dtype=jnp.float32), self.wgate(xf, dtype=jnp.float32)

    def pool(self, c: Float[Array, "*B ratio H"], z: Float[Array, "*B ratio H"], dtype) -> Float[Array, "*B H"]:
        """Per-channel softmax over a group's m tokens, pool, cast, RMSNorm (pool first, then cast: §3.3)."""
        pooled = (jax.nn.softmax(z, axis=-2) * c).sum(axis=-2)
        return self.norm(pooled.astype(dtype))
