"""Muon as the V4.1 recipe states it (spec model §9.2), per matrix, per head, per group or per expert.

    M ← μ·M + G ;  D ← μ·M + G (Nesterov) ;  O ← NS(D)·sqrt(max(m, n))·rms ;  (decay and LR are chained after)

``optax.contrib.scale_by_muon`` is not used for the momentum: it keeps an EMA with bias correction, so its
Nesterov mix of momentum and gradient differs from the spec's in the first few hundred steps (a test shows
it). Its orthogonaliser is exact for the spec's NS (frobenius pre-scaling, a per-iteration coefficient
table, batching through ``MuonDimensionNumbers``), so that part is reused.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float
from optax.contrib import MuonDimensionNumbers
from optax.contrib._muon import orthogonalize_via_newton_schulz  # not re-exported by optax 0.2.8; tests pin it

# our weights are stored [..., out, in]: leading axes are batch (experts / heads / groups), each
# matrix is orthogonalised on its own (the transposition optax may do inside is exact: NS(Xᵀ) = NS(X)ᵀ)
_OUT_IN = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)


class MuonState(NamedTuple):
    momentum: optax.Updates  # M, one buffer per parameter


def newton_schulz(x: Float[Array, "*B Y X"], schedule: tuple[tuple[float, float, float], ...],
                  eps: float, dtype: str = "float32") -> Float[Array, "*B Y X"]:
    """``X₀ = D/(‖D‖_F + eps)``, then ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` with one (a, b, c) per iteration.

    Leading axes are batch: every trailing [m, n] matrix is orthogonalised separately. ``dtype`` is that of
    the iteration: ``float32`` runs its matmuls at JAX's default precision (exact fp32 on CPU; TF32 may be
    used on GPU unless ``jax_default_matmul_precision`` says otherwise); ``bfloat16`` (what Muon's authors
    and the V4 report run) scales ``X₀`` in fp32, then iterates in bf16 (products accumulate in fp32 and are
    rounded to bf16, coefficients included). The result has ``x``'s dtype.
    """
    out_dtype = x.dtype
    if jnp.dtype(dtype) != jnp.float32:
        x = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
        x = (x / (norm + eps)).astype(dtype)  # optax's own Frobenius scaling then divides by ≈ 1
    coeffs = jnp.asarray(schedule, jnp.float32)  # [iterations, 3]; optax casts them to the iteration's dtype
    dims = None if x.ndim == 2 else _OUT_IN
    return orthogonalize_via_newton_schulz(x, coeffs, len(schedule), "frobenius", eps, dims).astype(out_dtype)


def split_rows(x: Float[Array, "*B Y X"], blocks: int) -> Float[Array, "*B blocks Y/blocks X"]:
    """View rows [Y, X] as ``blocks`` matrices [Y/blocks, X]: heads of ``wq_b``, groups of ``wo_a`` (row-major,
    head-major)."""
    if x.shape[-2] % blocks:
        raise ValueError(f"cannot split {x.shape[-2]} rows into {blocks} equal blocks (shape {x.shape})")
    return x.reshape(*x.shape[:-2], blocks, x.shape[-2] // blocks, x.shape[-1])


def orthogonalized_update(d: Float[Array, "*B Y X"], *, blocks: int, schedule, rms: float,
                          eps: float, ns_dtype: str = "float32") -> Float[Array, "*B Y X"]:
    """``NS(D)·sqrt(max(m, n))·rms`` for each [m, n] matrix of ``d`` (rows cut into ``blocks`` matrices)."""
    if d.ndim < 2:
        raise ValueError(f"Muon needs a matrix (or a stack of them), got shape {d.shape}")
    mats = split_rows(d, blocks) if blocks > 1 else d
    m, n = mats.shape[-2:]
    o = newton_schulz(mats.astype(jnp.float32), schedule, eps, ns_dtype) * (math.sqrt(max(m, n)) * rms)
    return o.reshape(d.shape)


def stacked_by_shape(fn, tree):
    """``jax.tree.map(fn, tree)`` for a ``fn`` that treats leading axes as a batch, called once per group of leaves
    of one shape and dtype, stacked on a new leading axis.

    The model's layers hold their matrices apart (one leaf per layer), so a per-leaf Newton–Schulz is ~30 small
    products per leaf, ~18,000 per step at ``configs/small.yaml``'s 40 layers; stacked, each iteration's
    products are one batched product per shape. The stack adds an unsharded leading axis; leaves of one shape
    share a role, and so a sharding, in every model config here (where two roles of one shape shard
    differently, XLA reshards one of them for the stack). Equal to the per-leaf map up to the batched
    products' summation order.
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault((tuple(x.shape), jnp.dtype(x.dtype)), []).append(i)
    out: list = [None] * len(leaves)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = fn(leaves[idx[0]])
            continue
        stacked = fn(jnp.stack([leaves[i] for i in idx]))
        for j, i in enumerate(idx):
            out[i] = stacked[j]
    return jax.tree.unflatten(treedef, out)


def scale_by_muon(*, momentum: float, nesterov: bool, schedule: tuple[tuple[float, float, float], ...], rms: float,
                  eps: float, blocks: int = 1, state_dtype=jnp.float32, ns_dtype: str = "float32"
                  ) -> optax.GradientTransformation:
    """The direction ``O`` of spec §9.2; chain decoupled weight decay and the learning rate after it."""

    def init_fn(params):
        return MuonState(momentum=optax.tree.zeros_like(params, dtype=state_dtype))

    def update_fn(updates, state, params=None):
        del params
        m = jax.tree.map(lambda m, g: momentum * m + g.astype(m.dtype), state.momentum, updates)
        d = jax.tree.map(lambda m, g: momentum * m + g.astype(m.dtype), m, updates) if nesterov else m
        o = stacked_by_shape(lambda x: orthogonalized_update(x, blocks=blocks, schedule=schedule, rms=rms, eps=eps,
                                                             ns_dtype=ns_dtype), d)
        return o, MuonState(momentum=m)

    return optax.GradientTransformation(init_fn, update_fn)
