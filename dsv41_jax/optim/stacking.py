"""Run a per-leaf optimizer transform once per group of same-shaped leaves instead of once per leaf.

The model holds each layer's parameters apart (one leaf per layer and name, as the checkpoint names them), so
an ``optax`` chain applied leaf by leaf issues its few elementwise operations ~1,000 times a step at
``configs/small.yaml`` (40 layers): ~14,500 of the train step's ~58,500 traced operations, a third of its
compile time on the CPU, and as many small kernels on a GPU. :func:`stack_leaves` wraps a transform so that
its update sees one stacked array per group of leaves of one shape and dtype (a :class:`Groups` in place of
every parameter-shaped tree, in the updates, the parameters and the state), then takes the results apart
again. The state it keeps is the wrapped transform's own, leaf for leaf, so checkpoints do not change.

Every transform wrapped here treats leading axes as a batch (elementwise updates, Newton–Schulz batched over
``*B``, Sinkhorn vmapped over stacked tables), so the result equals the per-leaf one up to the summation
order of batched products. Stacking copies the operands once (one concatenation per group; the results come
apart by one split).

On by default off the CPU (``optim.stack_leaves: null``; ``optimizer.stacked``). At ``configs/small.yaml`` the
optimizer's update (with ``apply_updates``) traces to 2.5k instead of 14.3k operations (``benchmarks/optim_bench.py``,
BENCHMARKS.md). On an H100 (jax 0.11.2) the stacked update compiles in 17.3 s instead of 22.7 (30.8k optimized HLO
lines instead of 45.1k) and runs in 148.8 ms instead of 155.0; XLA:CPU (jax 0.10.2) compiles it in 41.2 s instead
of 20.1 s, so the CPU keeps the per-leaf form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


class Groups(tuple):
    """One stacked array per group of leaves: the stacked form of a parameter-shaped tree."""


jax.tree_util.register_pytree_node(Groups, lambda g: (tuple(g), None), lambda _, children: Groups(children))


def stack_leaves(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on stacked groups of same-shaped leaves; state and results as ``inner``'s own."""

    def update_fn(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(leaves)
        groups: dict[tuple, list[int]] = {}
        for i, (u, p) in enumerate(zip(leaves, p_leaves, strict=True)):
            key = (tuple(u.shape), jnp.dtype(u.dtype), None if p is None else jnp.dtype(p.dtype))
            groups.setdefault(key, []).append(i)
        if len(groups) == len(leaves):  # nothing to stack
            return inner.update(updates, state, params)
        order = list(groups.values())

        def is_tree(x) -> bool:
            return not isinstance(x, Groups) and jax.tree.structure(x) == treedef

        def pack(tree):
            if not is_tree(tree):
                return tree
            flat = treedef.flatten_up_to(tree)
            return Groups(_stack([flat[i] for i in idx]) for idx in order)

        def unpack(g):
            if not isinstance(g, Groups):
                return g
            out: list = [None] * len(leaves)
            for idx, stacked in zip(order, g, strict=True):
                for i, x in zip(idx, _unstack(stacked), strict=True):
                    out[i] = x
            return treedef.unflatten(out)

        stacked_state = jax.tree.map(pack, state, is_leaf=is_tree)
        new_updates, new_state = inner.update(pack(updates), stacked_state, None if params is None else pack(params))
        is_groups = lambda x: isinstance(x, Groups)  # noqa: E731
        return unpack(new_updates), jax.tree.map(unpack, new_state, is_leaf=is_groups)

    return optax.GradientTransformation(inner.init, update_fn)


def _stack(xs: list[jax.Array]) -> jax.Array:
    """``jnp.stack(xs)`` as one concatenation along the leading axis (not one reshape per leaf as well)."""
    if len(xs) == 1 or xs[0].ndim == 0:
        return jnp.stack(xs)
    return jnp.concatenate(xs, axis=0).reshape(len(xs), *xs[0].shape)


def _unstack(x: jax.Array) -> list[jax.Array]:
    """The leaves of a stack: one split of the leading axis (not one slice and one reshape per leaf)."""
    n, shape = x.shape[0], x.shape[1:]
    if n == 1 or not shape:
        return [x[i] for i in range(n)]
    return jax.lax.split(x.reshape(n * shape[0], *shape[1:]), [shape[0]] * n, axis=0)
