"""Engram conditional n-gram memory, applied to the residual streams before its block (spec model §6.6).

Row ids are computed on the host (``dsv41_jax.engram_hash``) and arrive as int32 ``[B, S, G]`` per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import EngramConfig
from dsv41_jax.model.layers import Linear, normal
from dsv41_jax.sharding import param


class Table(nnx.Module):
    """The Engram embedding table [rows, H].

    ``native=True`` holds the release's storage (spec model §2.2): ``weight`` float8_e4m3fn [rows, H] and a
    per-row ``scale`` [rows, H/32] of E8M0 bytes; only the gathered rows are dequantised (spec model §2.5).
    """

    def __init__(self, rows: int, width: int, *, param_dtype, rngs: nnx.Rngs, native: bool = False):
        w = normal(rngs, (rows, width), 1.0, jnp.float32 if native else param_dtype)
        if native:
            w, scale = quant.quantize_fp8_blocks(w, block=(1, quant.FP8_BLOCK))
            self.scale = param("engram_table", scale)
        self.weight = param("engram_table", w)
        self.native = native

    def lookup(self, rows: Int[Array, "*B"]) -> Float[Array, "*B H"]:
        """The rows ``rows`` (float32 when native: FP8 x power of two is exact there)."""
        emb = jnp.take(self.weight[...], rows, axis=0)
        if self.native:
            return quant.dequant_fp8_rows(emb, jnp.take(self.scale[...], rows, axis=0))
        return emb


class Engram(nnx.Module):
    def __init__(self, cfg: EngramConfig, rows: int, dim: int, hc_mult: int, norm_eps: float, *, dtype,
                 param_dtype, rngs: nnx.Rngs, native: bool = False):
        self.embed = Table(rows, cfg.head_dim, param_dtype=param_dtype, rngs=rngs, native=native)
        self.wkv = Linear(cfg.n_columns * cfg.head_dim, (hc_mult + 1) * dim, "engram_proj", dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs, native=native)
        self.q_weight = param("engram_qk", jnp.ones((hc_mult, dim), param_dtype))
        self.k_weight = param("engram_qk", jnp.ones((hc_mult, dim), param_dtype))
        self.norm_eps, self.dtype = norm_eps, dtype

    def __call__(self, x: Float[Array, "B S M D"], rows: Int[Array, "B S G"],
                 dead: Bool[Array, "B S"] | None = None) -> Float[Array, "B S M D"]:
        b, s, m, d = x.shape
        emb = self.embed.lookup(rows).astype(self.dtype)  # [B, S, G, H]
        kv = self.wkv(emb.reshape(b, s, -1))  # [B, S, (M+1)·D]
        key = kv[..., : m * d].astype(jnp.float32).reshape(b, s, m, d)
        val = kv[..., m * d:].astype(jnp.float32)  # one value shared by all streams
        w = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)  # [M, D]
        h = x.astype(jnp.float32)
        rho = (jax.lax.rsqrt(jnp.mean(h * h, -1) + self.norm_eps)
               * jax.lax.rsqrt(jnp.mean(key * key, -1) + self.norm_eps))  # per (token, stream)
        dot = (h * w * key).sum(-1) * rho / jnp.sqrt(jnp.float32(d))
        # signed square root, then sigmoid (matches the training kernel, spec §6.6)
        gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
        if dead is not None:
            gate = jnp.where(dead[..., None], 0.0, gate)
        return (h + gate[..., None] * val[:, :, None, :]).astype(x.dtype)
