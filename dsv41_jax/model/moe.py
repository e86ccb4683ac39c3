"""MoE: sqrtsoftplus router with selection biases, clamped-SwiGLU experts, one shared expert (spec model §5).

Routed experts are computed with a grouped matmul over tokens sorted by expert (``lax.ragged_dot``), the
portable path; faster GPU paths and expert parallelism plug in behind :func:`routed_experts`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import MoEConfig
from dsv41_jax.model.layers import Linear, normal
from dsv41_jax.sharding import PARAM_AXES, param


class RouterBias(nnx.Variable):
    """Selection bias of the router: updated by the aux-loss-free rule, never by the optimizer (§5.3)."""


class Routing(NamedTuple):
    experts: Int[Array, "B S K"]  # selected experts (biased selection)
    weights: Float[Array, "B S K"]  # routing weights (unbiased, normalised, × route_scale)
    scores: Float[Array, "B S E"]  # sqrtsoftplus affinities, for the balance loss


class Gate(nnx.Module):
    def __init__(self, cfg: MoEConfig, dim: int, n_experts: int, k: int, *, param_dtype, rngs: nnx.Rngs):
        self.weight = param("router", normal(rngs, (n_experts, dim), dim ** -0.5, param_dtype))
        axes = PARAM_AXES["router_bias"]
        self.bias = RouterBias(jnp.zeros((n_experts,), jnp.float32), out_sharding=axes, eager_sharding=False)
        self.bias_vl = RouterBias(jnp.zeros((n_experts,), jnp.float32), out_sharding=axes, eager_sharding=False)
        self.cfg, self.k = cfg, k

    def __call__(self, x: Float[Array, "B S D"], is_image: Bool[Array, "B S"] | None) -> Routing:
        cfg = self.cfg
        logits = jnp.einsum("bsd,ed->bse", x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
                            precision="highest") / cfg.gate_temp
        scores = jnp.sqrt(jax.nn.softplus(logits))
        bias = self.bias[...] if is_image is None else jnp.where(is_image[..., None], self.bias_vl[...],
                                                                 self.bias[...])
        _, experts = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), self.k)  # bias steers selection only
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if cfg.norm_topk_prob and self.k > 1:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)  # literal 1e-20 (spec §5.1)
        return Routing(experts, weights * cfg.route_scale, scores)


class StackedLinear(nnx.Module):
    """``n`` expert matrices stacked on a leading axis: weight [E, out, in].

    ``native=True`` holds the release's MXFP4 storage (spec model §2.2): ``weight`` uint8 [E, out, in/2]
    (two E2M1 codes per byte, low nibble = even column) and ``scale`` [E, out, in/32] E8M0 bytes.
    """

    def __init__(self, n: int, d_in: int, d_out: int, role: str, *, param_dtype, rngs: nnx.Rngs,
                 native: bool = False):
        w = normal(rngs, (n, d_out, d_in), d_in ** -0.5, jnp.float32 if native else param_dtype)
        if native:
            w, scale = quant.quantize_fp4_rows(w)
            self.scale = param(role, scale)
        self.weight = param(role, w)
        self.native = native

    def dense(self, dtype) -> Float[Array, "E O I"]:
        """All experts as ``dtype`` matrices (dequantised on the fly when native; exact in bf16 and fp32)."""
        if self.native:
            return quant.dequant_fp4_rows(self.weight[...], self.scale[...]).astype(dtype)
        return self.weight[...].astype(dtype)


class Experts(nnx.Module):
    def __init__(self, n: int, dim: int, inter: int, *, param_dtype, rngs: nnx.Rngs, native: bool = False):
        kw = dict(param_dtype=param_dtype, rngs=rngs, native=native)
        self.w1 = StackedLinear(n, dim, inter, "expert_up", **kw)
        self.w2 = StackedLinear(n, inter, dim, "expert_down", **kw)
        self.w3 = StackedLinear(n, dim, inter, "expert_up", **kw)


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, inter: int, *, dtype, param_dtype, rngs: nnx.Rngs, native: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, native=native)
        self.w1 = Linear(dim, inter, "mlp_up", **kw)
        self.w2 = Linear(inter, dim, "mlp_down", **kw)
        self.w3 = Linear(dim, inter, "mlp_up", **kw)

    def __call__(self, x: Float[Array, "*B D"], limit: float) -> Float[Array, "*B D"]:
        act = clamped_swiglu(self.w1(x).astype(jnp.float32), self.w3(x).astype(jnp.float32), limit)
        return self.w2(act.astype(x.dtype))


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``silu(min(g, limit)) · clip(u, ±limit)`` in fp32 (spec model §5.2)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def routed_experts(x: Float[Array, "T D"], experts: Int[Array, "T K"], weights: Float[Array, "T K"],
                   module: Experts, limit: float) -> Float[Array, "T D"]:
    """Σ_k weight_k · Expert_{e_k}(x) in fp32, by sorting token copies by expert and a grouped matmul."""
    t, k = experts.shape
    n = module.w1.weight.shape[0]
    dt = x.dtype
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=n).astype(jnp.int32)
    xs = x[token]  # [T·K, D]

    def grouped(lhs, w: StackedLinear):  # [E, out, in] -> rhs [E, in, out]
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(w.dense(dt), 1, 2), sizes,
                                  preferred_element_type=jnp.float32)

    act = clamped_swiglu(grouped(xs, module.w1), grouped(xs, module.w3), limit)
    act = act * weights.reshape(-1)[order][:, None]  # routing weight before w2 (spec §5.2)
    out = grouped(act.astype(dt), module.w2)
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[token].add(out)


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, dim: int, n_experts: int, k: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 native: bool = False):
        kw = dict(param_dtype=param_dtype, rngs=rngs, native=native)
        self.gate = Gate(cfg, dim, n_experts, k, param_dtype=param_dtype, rngs=rngs)  # bf16 in the release
        self.experts = Experts(n_experts, dim, cfg.moe_inter_dim, **kw)
        self.shared_experts = SwiGLU(dim, cfg.moe_inter_dim, dtype=dtype, **kw)
        self.cfg = cfg

    def __call__(self, x: Float[Array, "B S D"], is_image: Bool[Array, "B S"] | None = None):
        b, s, d = x.shape
        routing = self.gate(x, is_image)
        flat = x.reshape(b * s, d)
        y = routed_experts(flat, routing.experts.reshape(b * s, -1), routing.weights.reshape(b * s, -1),
                           self.experts, self.cfg.swiglu_limit)
        y = y + self.shared_experts(flat, self.cfg.swiglu_limit).astype(jnp.float32)
        return y.reshape(b, s, d).astype(x.dtype), routing
