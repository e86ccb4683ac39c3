"""Sinkhorn-balanced momentum for token/row-indexed tables (spec model §9.3, report Algorithm 1).

    M ← β·M + (1−β)·G ;  N ← β·M + (1−β)·G           (one persistent buffer)
    rows with ‖N_i‖ ≤ τ·mean_i ‖N_i‖ are zeroed (mask computed once)
    K alternating L2 normalisations, rows first:  U_i ← U_i/(‖U_i‖ + ε) ;  U_j ← U_j/(‖U_j‖ + ε)
    Δ = sqrt(n)·U                                      (the caller scales by γ·lr·lr_mult, no weight decay)

The loop keeps U = diag(r)·N·diag(c) as two scaling vectors instead of rewriting the table K times
(the closed form the spec states; the report's kernel does the same, spec §6.7): every step is one
reduction over N and only Δ is written. All reductions are over the whole logical table, so when the
table is sharded (rows over the mesh, spec §6.7) the row norms combine every feature shard and the
column norms and the mean row norm every row shard: XLA inserts the cross-device sums.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float


class SinkhornState(NamedTuple):
    momentum: optax.Updates  # M, the only state (Adam would keep two; spec §9.3)


def row_mask(n: Float[Array, "V X"], tau: float) -> Float[Array, "V"]:
    """1 for rows whose L2 norm exceeds τ·(mean row norm over all rows, zero rows included), else 0."""
    rho = jnp.sqrt(jnp.sum(n * n, axis=-1))  # [V]
    return (rho > tau * jnp.mean(rho)).astype(jnp.float32)


def _normalize(scale: Float[Array, " line"], norm: Float[Array, " line"], eps: float) -> Float[Array, " line"]:
    """``scale / (scale·norm + eps)``: the scaling after ``U ← U/(‖U‖ + eps)`` along one axis.

    An all-zero line of N (an unseen token's row, a feature no row uses) stays zero whatever its scale, but
    ``scale/eps`` would grow by 1e20 a step and overflow to inf (then 0·inf = NaN): keep its scale.
    """
    return jnp.where(norm > 0, scale / (scale * norm + eps), scale)


def sinkhorn_direction(n: Float[Array, "V X"], *, tau: float, iters: int, eps: float) -> Float[Array, "V X"]:
    """``Δ = sqrt(X)·U`` of Algorithm 1 (its sqrt(D)) for one table ``n`` [rows V, features X] (fp32)."""
    if n.ndim != 2:
        raise ValueError(f"Sinkhorn-balanced momentum needs a 2-D table [rows, features], got shape {n.shape}")
    n = n.astype(jnp.float32)
    r = row_mask(n, tau)  # [V]
    c = jnp.ones((n.shape[1],), jnp.float32)  # [X]
    for step in range(iters):
        if step % 2 == 0:  # ‖U_i‖ = r_i·‖N_i ⊙ c‖
            r = _normalize(r, jnp.sqrt(jnp.sum(jnp.square(n * c[None, :]), axis=1)), eps)
        else:  # ‖U_:j‖ = c_j·‖r ⊙ N_:j‖
            c = _normalize(c, jnp.sqrt(jnp.sum(jnp.square(n * r[:, None]), axis=0)), eps)
    return math.sqrt(n.shape[1]) * (r[:, None] * n * c[None, :])


def _tables(fn, ndim: int):
    """``fn`` of one [V, X] table, vmapped over any leading axes (tables stacked by
    :mod:`~dsv41_jax.optim.stacking`)."""
    for _ in range(max(ndim - 2, 0)):
        fn = jax.vmap(fn)
    return fn


def scale_by_sinkhorn(*, momentum: float, tau: float, iters: int, eps: float,
                      state_dtype=jnp.float32) -> optax.GradientTransformation:
    """The direction ``Δ`` of spec §9.3 for every (2-D) leaf; chain ``scale(γ·lr_mult)`` and the LR after it."""

    def init_fn(params):
        return SinkhornState(momentum=optax.tree.zeros_like(params, dtype=state_dtype))

    def update_fn(updates, state, params=None):
        del params
        m = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g.astype(m.dtype), state.momentum, updates)
        nest = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g.astype(m.dtype), m, updates)
        direction = functools.partial(sinkhorn_direction, tau=tau, iters=iters, eps=eps)
        delta = jax.tree.map(lambda x: _tables(direction, x.ndim)(x), nest)
        return delta, SinkhornState(momentum=m)

    return optax.GradientTransformation(init_fn, update_fn)
