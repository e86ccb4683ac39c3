"""Logical axis names of every parameter, and the one table that maps them onto mesh axes.

Modules create parameters through :func:`param` with a *role*; the role's logical axes come from
``PARAM_AXES``. A mesh shards the model by ``LOGICAL_RULES`` (logical axis → mesh axis) without touching
model code. Mesh axes: ``data``, ``fsdp``, ``expert``, ``tensor``.

Activations are pinned at block boundaries by :func:`constrain_batch` (batch over ``BATCH_AXES``, the rest
whole) while a traced function runs under :func:`activation_sharding`; without that context they are left
to the compiler, so the model runs unchanged on one device and in the engine.

Dimension glossary (used in einsum strings, shape annotations and names here): B batch, S/T query/key
length, D model, N heads, H head dim, E experts, K top-k, C compressed entries, M mHC streams, V vocab.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")  # mesh axes that split the batch (experts see the tokens of their group)

# role -> logical axes of the parameter, in the checkpoint's [out, in] layout
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "head": ("vocab", "embed"),
    "norm": (None,),
    "q_down": ("q_lora", "embed"),  # attn.wq_a
    "q_up": ("heads", "q_lora"),  # attn.wq_b: out = N·H
    "kv_down": ("kv", "embed"),  # attn.wkv, compressor.wkv / wgate
    "out_group": ("heads", None),  # attn.wo_a: [O·R, N/O·H], grouped by heads
    "out_proj": ("embed", "heads"),  # attn.wo_b: [D, O·R]
    "sink": ("heads",),
    "index_q_up": ("heads", "q_lora"),  # indexer.wq_b
    "index_weights": ("heads", "embed"),  # indexer.weights_proj
    "index_k": (None, "kv"),  # indexer.wk
    "router": ("experts", "embed"),
    "router_bias": ("experts",),
    "expert_up": ("experts", "expert_hidden", "embed"),  # experts.w1 / w3: [E, F, D]
    "expert_down": ("experts", "embed", "expert_hidden"),  # experts.w2: [E, D, F]
    "mlp_up": ("mlp", "embed"),  # shared_experts.w1 / w3
    "mlp_down": ("embed", "mlp"),  # shared_experts.w2
    "hc_fn": (None, "embed"),
    "hc_vector": (None,),
    "engram_table": ("engram_rows", "engram_cols"),  # rows first; columns take the mesh axes rows leave
    "engram_proj": ("embed", None),  # engram.wkv: [(M+1)·D, C·H]
    "engram_qk": (None, "embed"),
    "main_proj": ("embed", None),  # DSpark mtp.0.main_proj: [D, targets·D]
    "markov": ("vocab", None),  # DSpark Markov head embed / head: [V, r]
    "confidence": (None, None),  # DSpark confidence head: [1, D + r]
    # vision tower (dsv41_jax.vision): the ViT's own width stays whole, its wide axes split like an MLP's
    "vit_patch": (None, None),  # vision.patch_embed.proj: [Dv, 3·14·14]
    "vit_patch_bias": (None,),
    "vit_up": ("vit_mlp", None),  # attn.wqkv [3·Dv, Dv], mlp.w1 [2·F, Dv]
    "vit_up_bias": ("vit_mlp",),
    "vit_down": (None, "vit_mlp"),  # attn.wo [Dv, Dv], mlp.w2 [Dv, F]
    "vit_down_bias": (None,),
    "aligner_in": ("mlp", None),  # aligner.w1: [D, 9·Dv]
    "aligner_in_bias": ("mlp",),
    "aligner_out": ("embed", "mlp"),  # aligner.w2: [D, D]
    "aligner_out_bias": (None,),
    "image_delimiter": (None,),  # image_start / image_end / image_newline: [D]
}

# logical axis -> mesh axis (or tuple of mesh axes); absent means replicated
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "q_lora": None,
    "kv": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_hidden": "tensor",
    "engram_rows": ("fsdp", "expert"),
    "engram_cols": ("fsdp", "expert"),
    "vit_mlp": "tensor",
}


def param(role: str, value: jax.Array) -> nnx.Param:
    """A parameter annotated with the logical axes of its role (no mesh needed at creation)."""
    axes = PARAM_AXES[role]
    if len(axes) != value.ndim:
        raise ValueError(f"role {role!r} has {len(axes)} logical axes but the value has shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def logical_to_mesh(axes: tuple[str | None, ...], rules=None, shape: tuple[int, ...] | None = None,
                    mesh: jax.sharding.Mesh | None = None) -> P:
    """The PartitionSpec of a parameter with logical ``axes``.

    A mesh axis shards at most one dimension: a dimension gets the axes of its rule that earlier dimensions
    left unused. With ``shape`` and ``mesh``, it keeps the longest leading run of those whose total size
    divides it and is replicated if none does. So an Engram table, whose row count is a sum of primes, is
    split by rows where the mesh divides them and by columns with the axes the rows could not use.
    """
    rules = LOGICAL_RULES if rules is None else rules
    spec, used = [], set()
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        run = tuple(a for a in ((target,) if isinstance(target, str) else target) if a not in used)
        if shape is not None and mesh is not None:
            while run and shape[i] % math.prod(mesh.shape[a] for a in run):
                run = run[:-1]
        used.update(run)
        spec.append(None if not run else run[0] if len(run) == 1 else run)
    return P(*spec)


def state_partition_specs(state: nnx.State, rules=None, mesh: jax.sharding.Mesh | None = None) -> nnx.State:
    """PartitionSpecs in mesh axes for every variable of ``state`` (from its logical annotation)."""
    def spec(v):
        axes = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        return logical_to_mesh(tuple(axes), rules, tuple(v.shape), mesh) if axes else P()
    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(mesh: jax.sharding.Mesh, specs):
    """A tree of PartitionSpecs as NamedShardings on ``mesh`` (for ``device_put`` / ``jit`` shardings)."""
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


_ACTIVATION_MESH: contextvars.ContextVar = contextvars.ContextVar("dsv41_activation_mesh", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh | None):
    """Trace :func:`constrain_batch` as real sharding constraints on ``mesh`` (``None``: leave them out).

    Read at trace time: wrap the body of the jitted function (the train step), not the call of a compiled one.
    """
    if mesh is not None and (missing := [a for a in BATCH_AXES if a not in mesh.axis_names]):
        raise ValueError(f"activation_sharding: the mesh {dict(mesh.shape)} has no axis {missing}; activations "
                         f"split their batch over {BATCH_AXES} (build the mesh with train.step.build_mesh)")
    token = _ACTIVATION_MESH.set(mesh)
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def batch_spec(mesh, batch: int, ndim: int) -> P:
    """Leading dimension over the longest leading run of ``BATCH_AXES`` whose size divides ``batch``."""
    axes: tuple[str, ...] = BATCH_AXES
    while axes and batch % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return P(axes or None, *(None,) * (ndim - 1))


def constrain_batch(tree):
    """Every array of ``tree`` (leading dimension = batch) split over the batch axes and whole otherwise.

    Under :func:`activation_sharding` only; elsewhere the identity. ``None`` leaves stay ``None``.
    """
    mesh = _ACTIVATION_MESH.get()
    if mesh is None:
        return tree
    one = lambda x: jax.lax.with_sharding_constraint(
        x, jax.sharding.NamedSharding(mesh, batch_spec(mesh, x.shape[0], x.ndim)))
    return jax.tree.map(one, tree)


def batch_local(fn, *args):
    """``fn(*args)`` run on each device's rows of the batch (``shard_map`` over the batch axes).

    For row-wise ops that XLA's partitioner would otherwise run on the gathered batch: ``lax.top_k`` is
    partitioned only along its sorted dimension, so a batch-split input is all-gathered onto every device.
    Every argument and result has the batch as its leading dimension. Under :func:`activation_sharding` only;
    elsewhere ``fn(*args)``.
    """
    mesh = _ACTIVATION_MESH.get()
    if mesh is None:
        return fn(*args)
    spec = lambda x: batch_spec(mesh, x.shape[0], x.ndim)
    return jax.shard_map(fn, mesh=mesh, in_specs=jax.tree.map(spec, args),
                         out_specs=jax.tree.map(spec, jax.eval_shape(fn, *args)), check_vma=False)(*args)


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)
