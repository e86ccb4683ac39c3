"""MoE: sqrtsoftplus router with selection biases, clamped-SwiGLU experts, one shared expert (spec model §5).

Routed experts are computed with a grouped matmul over tokens sorted by expert (:func:`grouped_matmul`:
Triton kernels over the groups' own rows on GPU, ``pallas_kernels.grouped_matmul``, as XLA's GPU ragged_dot
densifies; ``lax.ragged_dot`` elsewhere), or, for a few
token copies (a decode step), by gathering only the picked experts' weights (MXFP4 experts are dequantised
after the gather), or for a decode batch on GPU by running every expert on every token against the weights'
stored layout (:func:`routed_path` decides, at trace time). Under :func:`expert_parallel` with a mesh whose
``expert`` axis has several devices, each device holds only its slice of the experts and
:func:`routed_experts_ep` exchanges tokens instead of weights (``shard_map``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import MoEConfig
from dsv41_jax.config.schema import ROUTED_PATHS
from dsv41_jax.model.layers import Linear, gradient_dtype, normal
from dsv41_jax.sharding import BATCH_AXES, PARAM_AXES, batch_local, param
from pallas_kernels import grouped_matmul as pallas_grouped


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
        # bias steers selection only; top-k per row on each device's rows (sharding.batch_local)
        experts = batch_local(lambda v: jax.lax.top_k(v, self.k)[1], scores + jax.lax.stop_gradient(bias))
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

    def stored(self) -> tuple[Array, ...]:
        """The stored arrays: ``(weight,)``, or ``(codes, scale)`` when native.

        As JAX arrays: a model restored from a converted checkpoint may hold NumPy values, which a jitted
        caller closes over as constants."""
        held = (self.weight[...], self.scale[...]) if self.native else (self.weight[...],)
        return tuple(jnp.asarray(a) for a in held)

    def dense(self, dtype) -> Float[Array, "E Y X"]:
        """All experts as ``dtype`` matrices (dequantised on the fly when native; exact in bf16 and fp32)."""
        return _dequant(self.stored(), dtype)


def _dequant(stored: tuple[Array, ...], dtype) -> Array:
    return (quant.dequant_fp4_rows(*stored) if len(stored) == 2 else stored[0]).astype(dtype)


def take_experts(stored: tuple[Array, ...], ids: Int[Array, "*B"], dtype) -> Float[Array, "*B Y X"]:
    """Experts ``ids`` of :meth:`StackedLinear.stored` arrays [E, ...] as ``dtype`` matrices: the codes and
    scales of the picked experts are gathered first, so only they are read and dequantised."""
    return _dequant(tuple(jnp.take(a, ids, 0) for a in stored), dtype)


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


def grouped_matmul(lhs: Float[Array, "U X"], rhs: Float[Array, "E X Y"], sizes: Int[Array, "E"],
                   implementation: str = "auto") -> Float[Array, "U Y"]:
    """``out[u] = lhs[u] @ rhs[e]`` for the rows ``u`` of group ``e`` (rows sorted by group, ``sizes[e]`` each),
    fp32 accumulation and output; rows past the last group are zero.

    ``implementation``: ``xla`` (``lax.ragged_dot``: a loop over groups on CPU/TPU, densified on GPU, ~16
    TFLOP/s on the H200), ``tokamax`` (its ``ragged_dot`` forward: a Mosaic GPU kernel where the shapes allow,
    tokamax chooses, and falls back to XLA elsewhere; the gradients XLA's), ``pallas``
    (``pallas_kernels.grouped_matmul``: Triton kernels for the forward and both gradients, each over the groups'
    own rows; GPU, the Pallas interpreter on CPU for tests, refused elsewhere; ``small.yaml``'s MoE layer forward +
    backward 7.9× XLA's on an H100, BENCHMARKS.md), or ``auto``: pallas on GPU for bf16 operands where the
    experts' dimensions are multiples of 16, else XLA. The gradients are XLA's transpose of
    ``lax.ragged_dot`` in the operands' dtype, as :func:`~dsv41_jax.model.layers.mixed_einsum` computes them
    (:func:`_grouped`), or the Pallas kernels' with ``pallas``.
    """
    if implementation == "auto":
        # the kernels were measured (and tuned) with bf16 operands; fp32 runs (exactness checks) keep XLA's
        implementation = ("pallas" if jax.default_backend() == "gpu" and pallas_grouped.applies(lhs, rhs)
                          and lhs.dtype == rhs.dtype == jnp.bfloat16 else "xla")
    if implementation not in ("xla", "tokamax", "pallas"):
        raise ValueError(f"grouped_matmul implementation must be auto, xla, tokamax or pallas, got {implementation!r}")
    if implementation == "pallas":
        if not pallas_grouped.applies(lhs, rhs):
            raise ValueError(f"grouped_matmul pallas: experts of {rhs.shape[1]} x {rhs.shape[2]}; the kernels take "
                             "multiples of 16")
        if jax.default_backend() not in ("gpu", "cpu"):
            raise ValueError(f"grouped_matmul pallas: Triton kernels for GPU (the interpreter on CPU), not "
                             f"{jax.default_backend()}; use xla")
        return _pallas_grouped(lhs, rhs, sizes, jax.default_backend() == "cpu")
    if implementation == "tokamax" and _tokamax() is None:
        raise ImportError(f"moe.grouped_matmul: tokamax does not import ({_TOKAMAX_ERROR[0]}); pip install "
                          "'dsv41-jax[gpu]'")
    out = _grouped(lhs, rhs, sizes, implementation)
    if implementation == "xla":
        return out
    # tokamax's kernels leave the rows past the last group unwritten; the caller's sum must see zeros there
    return jnp.where((jnp.arange(lhs.shape[0]) < jnp.sum(sizes))[:, None], out, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, implementation: str) -> jax.Array:
    """The grouped matmul's forward by ``implementation``; its backward is the transpose of ``lax.ragged_dot``.

    tokamax 0.0.17's own backward was measured wrong on the H200 (``benchmarks/moe_bench.py``, bf16, 32,768 rows
    × 1024 → 384, 16 experts): its Mosaic GPU kernels refuse the fp32 cotangent of an fp32 output against bf16
    weights; fed a bf16 cotangent, the weight gradient was off by 9 % of its largest entry, and with rows past
    the last group (``tests/model/test_moe.py``'s GPU test) the input gradient was off by 1.0 where its largest
    entry was 6.0, as from rows its kernels leave unwritten (the forward leaves them so). Its forward equals
    ``lax.ragged_dot`` bit for bit there, so the forward is tokamax's, the input gradient is tokamax's forward
    against the transposed experts (rows past the last group zeroed), and the weight gradient is XLA's own.

    With bf16 operands the cotangent is rounded to bf16 and both transposed products run in bf16 with fp32
    accumulation (autodiff would run them as fp32 × bf16 products, promoted to fp32); fp32 operands take
    autodiff's own transpose.
    """
    if implementation == "tokamax":
        return _tokamax().ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)


def _grouped_fwd(lhs, rhs, sizes, implementation):
    return _grouped(lhs, rhs, sizes, implementation), (lhs, rhs, sizes)


def _grouped_bwd(implementation, res, g):
    lhs, rhs, sizes = res
    dtype = gradient_dtype(lhs, rhs)
    g = g.astype(dtype)
    if implementation != "tokamax":
        _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=dtype), lhs, rhs)
        return (*vjp(g), None)
    # the input gradient is a grouped matmul against the transposed experts: tokamax's forward kernel; the
    # weight gradient (contracting over each group's rows) stays XLA's transpose
    _, vjp = jax.vjp(lambda b: jax.lax.ragged_dot(lhs, b, sizes, preferred_element_type=dtype), rhs)
    d_lhs = _tokamax().ragged_dot(g, jnp.swapaxes(rhs, 1, 2).astype(dtype), sizes,
                                  preferred_element_type=jnp.float32)
    d_lhs = jnp.where((jnp.arange(lhs.shape[0]) < jnp.sum(sizes))[:, None], d_lhs, 0.0).astype(lhs.dtype)
    return d_lhs, *vjp(g), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_grouped(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    """The Pallas kernels' grouped matmul, fp32 out; its gradients are the same kernels (``interpret``: off GPU,
    the Pallas interpreter: tests). With bf16 operands the cotangent is rounded to bf16, as :func:`_grouped`."""
    return pallas_grouped.rows_matmul(lhs, rhs, sizes, interpret=interpret)


def _pallas_grouped_fwd(lhs, rhs, sizes, interpret):
    return _pallas_grouped(lhs, rhs, sizes, interpret), (lhs, rhs, sizes)


def _pallas_grouped_bwd(interpret, res, g):
    lhs, rhs, sizes = res
    g = g.astype(gradient_dtype(lhs, rhs))
    d_lhs = pallas_grouped.rows_matmul(g, jnp.swapaxes(rhs, 1, 2).astype(g.dtype), sizes, interpret=interpret)
    d_rhs = pallas_grouped.weights_matmul(lhs.astype(g.dtype), g, sizes, interpret=interpret)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


_pallas_grouped.defvjp(_pallas_grouped_fwd, _pallas_grouped_bwd)

_TOKAMAX_ERROR: list[str] = []


@functools.cache
def _tokamax():
    """tokamax, or None (its import error kept for the message) where it is not installed."""
    try:
        import tokamax
    except ImportError as err:
        _TOKAMAX_ERROR.append(f"{type(err).__name__}: {err}")
        return None
    return tokamax


DENSE_MAX_TOKENS = 128  # dense routed experts while the rows are this few (their matmuls stay bandwidth-bound)


def routed_path(copies: int, tokens: int, n_experts: int, path: str = "auto", *, stored: float = 1.0,
                dequantised: float = 0.0, backend: str | None = None) -> str:
    """How ``copies`` token copies (``tokens`` × K) reach ``n_experts`` experts: ``gather`` (only the picked
    experts' weights, :func:`_gathered_experts`), ``dense`` (every expert on every token, :func:`_dense_experts`)
    or ``grouped`` (copies sorted by expert, :func:`grouped_matmul`); static, decided at trace time from shapes,
    dtypes and the backend (``jax.default_backend()`` unless given).

    ``auto`` picks by the bytes moved per expert parameter. The grouped matmul and the dense form read each
    expert's ``stored`` bytes once and, when the weights are not held in the activation dtype (MXFP4, or fp32
    weights under bf16 activations), write and read the converted matrix (``dequantised`` = twice the
    activation's itemsize). On GPU a gathered copy is read inside the kernel that uses it (the fused form:
    ``stored`` bytes, dequantised in registers), so auto gathers while copies · s < E · (s + d): fewer copies
    than experts in the activation dtype (the engine-bench model's 6 of 16 at batch 1), ~8.5 E for MXFP4 under
    bf16 (the release's 384 experts up to batch ~540). Otherwise, on GPU, the dense form up to
    :data:`DENSE_MAX_TOKENS` tokens (XLA:GPU's ragged dot also copies every weight transposed; H100,
    BENCHMARKS.md: 16 experts of 1024 × 2048 at 8–128 tokens, dense 316–353 µs a layer against 344–515), the
    grouped matmul beyond. Elsewhere the gathered copies are materialised (``take``: read, written and read
    again, 3s + d a copy), so auto gathers while copies · (3s + d) < E · (s + d) and else takes the grouped
    matmul: 3 · copies < E in the activation dtype, copies < 0.81 · E for MXFP4 under bf16.
    ``gather`` / ``dense`` / ``grouped`` force a path (benchmarks, equivalence tests).
    """
    if path not in ROUTED_PATHS:
        raise ValueError(f"moe routed path must be one of {', '.join(ROUTED_PATHS)}, got {path!r}")
    if path != "auto":
        return path
    gpu = (backend or jax.default_backend()) == "gpu"
    grouped = stored + dequantised
    gathered = stored if gpu else 2 * stored + grouped
    if copies * gathered < n_experts * grouped:
        return "gather"
    return "dense" if gpu and tokens <= DENSE_MAX_TOKENS else "grouped"


def _read_bytes(m: StackedLinear, dtype) -> dict[str, float]:
    """:func:`routed_path`'s ``stored`` / ``dequantised`` bytes per parameter of ``m``'s experts under ``dtype``
    activations (MXFP4: half a byte per code plus an E8M0 byte per 32)."""
    w = m.weight
    stored = 0.5 + 1 / quant.MXFP4_BLOCK if m.native else jnp.dtype(w.dtype).itemsize
    cast = m.native or jnp.dtype(w.dtype) != jnp.dtype(dtype)
    return {"stored": float(stored), "dequantised": float(2 * jnp.dtype(dtype).itemsize) if cast else 0.0}


def routed_experts(x: Float[Array, "U D"], experts: Int[Array, "U K"], weights: Float[Array, "U K"],
                   module: Experts, limit: float, implementation: str = "auto", path: str = "auto"
                   ) -> Float[Array, "U D"]:
    """Σ_k weight_k · Expert_{e_k}(x) in fp32, by :func:`routed_path`: the picked experts' gathered weights (a
    decode step: U·K = 6 per sequence against 384 experts, so the step reads U·K expert matrices rather than
    all of them), every expert on every token (a decode batch on GPU), or token copies sorted by expert and a
    grouped matmul. ``implementation``: :func:`grouped_matmul`'s; ``path``: :func:`routed_path`'s.
    """
    mats = (module.w1, module.w2, module.w3)
    how = routed_path(experts.size, x.shape[0], module.w1.weight.shape[0], path, **_read_bytes(module.w1, x.dtype))
    if how == "gather":
        return _gathered_experts(x, experts, weights, tuple(m.stored() for m in mats), limit, fused=_fuses())
    w1, w2, w3 = (m.dense(x.dtype) for m in mats)
    if how == "dense":
        return _dense_experts(x, experts, weights, w1, w2, w3, limit)
    return _local_experts(x, experts, weights, w1, w2, w3, limit, first=0, implementation=implementation)


def _fuses() -> bool:
    """Whether the gathered experts take the fused form: on GPU, where XLA fuses the gather into the reductions
    (H100, 16 experts of 1024 × 2048, one token: 90 against 173 µs a layer, BENCHMARKS.md). Not on CPU, where
    it would not pay, and where XLA:CPU (jax 0.10.2) turns these reductions into YNNPACK fusions that returned
    wrong sums at the engine-bench shape (1.5e-3 of the largest output against the take + einsum form, 2.6e-7
    with ``--xla_cpu_experimental_ynn_fusion_type=``)."""
    return jax.default_backend() == "gpu"


def _gathered_experts(x: Float[Array, "U D"], experts: Int[Array, "U K"], weights: Float[Array, "U K"],
                      stored: tuple[tuple[Array, ...], ...], limit: float, fused: bool = False) -> Float[Array, "U D"]:
    """Per token copy, its expert's three matrices gathered by id from ``stored`` (w1, w2, w3 as
    :meth:`StackedLinear.stored`): [U, K, F, D] then two batched matvecs and the weighted sum over K.

    ``fused``: the matvecs written as fp32 products summed by a reduction, so that XLA:GPU fuses the gather
    (and the MXFP4 dequantisation) into the reduction's kernel and each picked matrix is read once from the
    expert table, never copied; otherwise ``take`` materialises the copies and ``einsum`` multiplies them
    (one matmul, the better form where the copies are many or the backend has no such fusion). Either way
    the operands are the activation-dtype values (exact in fp32), the sums fp32, and the activation is
    rounded to the activation dtype before ``w2``.
    """
    dt, f32 = x.dtype, jnp.float32
    if fused:
        w1, w2, w3 = (take_experts(a, experts, f32) for a in stored)
        xf = x.astype(f32)[:, None, None, :]
        gate, up = jnp.sum(xf * w1, -1), jnp.sum(xf * w3, -1)
        act = (clamped_swiglu(gate, up, limit) * weights[..., None]).astype(dt).astype(f32)
        return jnp.sum(jnp.sum(act[:, :, None, :] * w2, -1), 1)
    w1, w2, w3 = (take_experts(a, experts, dt) for a in stored)
    gate = jnp.einsum("ud,ukfd->ukf", x, w1, preferred_element_type=f32)
    up = jnp.einsum("ud,ukfd->ukf", x, w3, preferred_element_type=f32)
    act = clamped_swiglu(gate, up, limit) * weights[..., None]  # routing weight before w2 (spec model §5.2)
    return jnp.einsum("ukf,ukdf->ud", act.astype(dt), w2, preferred_element_type=f32)


def _dense_experts(x: Float[Array, "U D"], experts: Int[Array, "U K"], weights: Float[Array, "U K"],
                   w1: Array, w2: Array, w3: Array, limit: float) -> Float[Array, "U D"]:
    """Every expert on every token, the unpicked ones weighted 0: ``w1``/``w3`` [E, F, D] as one matmul of the
    U rows against all E·F output columns and ``w2`` [E, D, F] as a matmul batched over experts, both against
    the stored [E, out, in] layout (no transposed copy of any weight). Reads each expert once, like the
    grouped matmul, in E/K times its FLOPs: the better form while the rows are few enough that the matmuls
    stay bound by reading the weights (a decode step of up to :data:`DENSE_MAX_TOKENS` tokens).

    The picked products are the grouped path's: the same activation-dtype operands and fp32 sums, the routing
    weight applied before rounding the activation (a token never picks an expert twice: ``top_k``)."""
    dt, f32 = x.dtype, jnp.float32
    combine = jnp.sum((experts[..., None] == jnp.arange(w1.shape[0])) * weights[..., None], axis=1)  # [U, E]
    gate = jnp.einsum("ud,efd->uef", x, w1, preferred_element_type=f32)
    up = jnp.einsum("ud,efd->uef", x, w3, preferred_element_type=f32)
    act = clamped_swiglu(gate, up, limit) * combine[..., None]
    return jnp.einsum("uef,edf->ued", act.astype(dt), w2, preferred_element_type=f32).sum(1)


def _local_experts(x: Float[Array, "U D"], experts: Int[Array, "U K"], weights: Float[Array, "U K"],
                   w1: Array, w2: Array, w3: Array, limit: float, first, implementation: str = "auto"
                   ) -> Float[Array, "U D"]:
    """The contribution of experts ``first .. first + n − 1`` (the rows of ``w1``/``w2``/``w3``) to every token.

    Token copies routed elsewhere sort after the local groups; :func:`grouped_matmul` leaves rows past the last
    group zero, so they add nothing. ``w1`` and ``w3`` run as one grouped matmul against their concatenation
    (the same products, one kernel of twice the width). The copies reach and leave the sorted order by
    permutations (:func:`_to_copies`, :func:`_from_copies`): gathers both ways, forward and backward, where
    indexing and ``.at[].add`` would transpose into scatter-adds (atomics on GPU, rounded per addition in bf16).
    """
    t, k = experts.shape
    n, f = w1.shape[0], w1.shape[1]
    local = experts.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < n), local, n)
    order = jnp.argsort(key, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype), unique_indices=True)
    sizes = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
    xs = _to_copies(x, order, inverse, k)  # [U·K, D] in expert order

    def grouped(lhs, w):  # [E, Y, X] -> rhs [E, X, Y]
        return grouped_matmul(lhs, jnp.swapaxes(w, 1, 2), sizes, implementation)

    gate_up = grouped(xs, jnp.concatenate([w1, w3], axis=1))
    act = clamped_swiglu(gate_up[:, :f], gate_up[:, f:], limit)
    mine = (key[order] < n)[:, None]
    route = _to_copies(weights.reshape(-1, 1), order, inverse, 1)  # each copy's routing weight, by permutation
    act = jnp.where(mine, act * route, 0.0)  # routing weight before w2 (§5.2)
    return _from_copies(grouped(act.astype(x.dtype), w2), order, inverse, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _to_copies(x: Float[Array, "T D"], order: Int[Array, "N"], inverse: Int[Array, "N"], k: int
               ) -> Float[Array, "N D"]:
    """Row ``i`` is token ``order[i] // k``'s copy (``N = T·K``, ``inverse`` the inverse permutation of
    ``order``). Its transpose (:func:`_from_copies`) puts the copies back in token order by ``inverse`` and
    sums each token's ``k`` of them in fp32: a gather and a reduction, never a scatter-add."""
    return x.at[order // k].get(mode="promise_in_bounds")  # in bounds by construction: no bounds select


def _to_copies_fwd(x, order, inverse, k):
    return _to_copies(x, order, inverse, k), (order, inverse)


def _to_copies_bwd(k, res, g):
    order, inverse = res
    return _from_copies(g, order, inverse, k).astype(g.dtype), None, None


_to_copies.defvjp(_to_copies_fwd, _to_copies_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _from_copies(y: Float[Array, "N D"], order: Int[Array, "N"], inverse: Int[Array, "N"], k: int
                 ) -> Float[Array, "T D"]:
    """Σ over each token's ``k`` copies of ``y`` (rows in :func:`_to_copies`' order), in fp32; the transpose of
    :func:`_to_copies`."""
    t = y.shape[0] // k
    back = y.at[inverse].get(mode="promise_in_bounds", unique_indices=True).astype(jnp.float32)
    return back.reshape(t, k, y.shape[-1]).sum(1)


def _from_copies_fwd(y, order, inverse, k):
    return _from_copies(y, order, inverse, k), (order, inverse, jnp.zeros((), y.dtype))


def _from_copies_bwd(k, res, g):
    order, inverse, like = res
    return _to_copies(g, order, inverse, k).astype(like.dtype), None, None


_from_copies.defvjp(_from_copies_fwd, _from_copies_bwd)


# ----------------------------------------------------------------------------------------------------
# expert parallelism

_EP_MESH: contextvars.ContextVar = contextvars.ContextVar("dsv41_expert_parallel_mesh", default=None)
TOKEN_AXES = BATCH_AXES  # mesh axes that may split the tokens entering an MoE layer


@contextlib.contextmanager
def expert_parallel(mesh: jax.sharding.Mesh | None):
    """Trace MoE layers expert-parallel over ``mesh``'s ``expert`` axis (no-op if it has one device).

    Read at trace time: wrap the body of the jitted function (the train step, the engine's forward), not the
    call site of an already compiled one.
    """
    token = _EP_MESH.set(mesh if mesh is not None and mesh.shape.get("expert", 1) > 1 else None)
    try:
        yield
    finally:
        _EP_MESH.reset(token)


def routed_experts_ep(x: Float[Array, "U D"], experts: Int[Array, "U K"], weights: Float[Array, "U K"],
                      module: Experts, limit: float, mesh: jax.sharding.Mesh, implementation: str = "auto",
                      path: str = "auto") -> Float[Array, "U D"]:
    """:func:`routed_experts` with the experts split over ``mesh``'s ``expert`` axis (``shard_map``).

    Tokens are split over as many of ``TOKEN_AXES`` as divide them. Each device gathers the tokens of its
    ``expert`` group (all-gather), runs its own experts on the copies routed to them, and the partial outputs
    are summed back onto the tokens' owners (reduce-scatter). If the tokens cannot be split over ``expert``
    (e.g. decode at batch 1), every device of a group holds all of them and the partial outputs are all-reduced.
    Exact: the same products as :func:`routed_experts`; only the fp32 sum over a token's experts is ordered
    differently. Traffic per MoE layer is 2·U·D per device, against U·K·D for an all-to-all dispatch: less
    while the ``expert`` axis is no larger than K. Each device computes its copies by :func:`routed_path`'s rule
    over its own experts: gathered (copies routed elsewhere take local expert 0 with weight 0), dense (they
    match no local expert) or grouped.
    """
    from jax.sharding import PartitionSpec as P

    n_ep = mesh.shape["expert"]
    n = module.w1.weight.shape[0]
    if n % n_ep:
        raise ValueError(f"{n} routed experts do not split over the mesh's expert axis of {n_ep} devices")
    axes, size = [], 1
    for a in TOKEN_AXES:
        if x.shape[0] % (size * mesh.shape[a]) == 0:
            axes.append(a)
            size *= mesh.shape[a]
    split = "expert" in axes
    tok = P(tuple(axes) or None)
    dt = x.dtype
    stored = [m.stored() for m in (module.w1, module.w2, module.w3)]
    per = len(stored[0])  # arrays per matrix: 1, or 2 when native (codes, scales)
    # counted over all tokens: every copy reaches every device of its group
    how = routed_path(experts.size, x.shape[0], n // n_ep, path, **_read_bytes(module.w1, dt))

    def body(x, e, w, *arrays):
        if split:
            x, e, w = (jax.lax.all_gather(v, "expert", axis=0, tiled=True) for v in (x, e, w))
        mats = tuple(arrays[i * per:(i + 1) * per] for i in range(3))
        first = jax.lax.axis_index("expert") * arrays[0].shape[0]
        if how == "gather":
            local = e - first
            mine = (local >= 0) & (local < arrays[0].shape[0])
            y = _gathered_experts(x, jnp.where(mine, local, 0), jnp.where(mine, w, 0.0), mats, limit, _fuses())
        else:
            w1, w2, w3 = (_dequant(a, dt) for a in mats)
            if how == "dense":  # ids of other devices' experts match no local expert: weight 0
                y = _dense_experts(x, e - first, w, w1, w2, w3, limit)
            else:
                y = _local_experts(x, e, w, w1, w2, w3, limit, first, implementation)
        if split:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert")

    wspec = P("expert", None, None)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *[wspec] * (3 * per)), out_specs=tok,
                         check_vma=False)(x, experts, weights, *(a for m in stored for a in m))


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
        mesh = _EP_MESH.get()
        args = (flat, routing.experts.reshape(b * s, -1), routing.weights.reshape(b * s, -1), self.experts,
                self.cfg.swiglu_limit)
        impl, path = self.cfg.grouped_matmul, self.cfg.routed_path
        y = routed_experts(*args, impl, path) if mesh is None else routed_experts_ep(*args, mesh, impl, path)
        y = y + self.shared_experts(flat, self.cfg.swiglu_limit).astype(jnp.float32)
        return y.reshape(b, s, d).astype(x.dtype), routing
