"""Optimizer-state memory per group, for any config, from shapes only (``jax.eval_shape``, no memory).

The bytes are read off the real optimizer's abstract state, so they count exactly what ``tx.init``
allocates: Muon and Sinkhorn keep one buffer per parameter, AdamW two, plus scalar step counters.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.optim import labels as L
from dsv41_jax.optim.config import OptimConfig
from dsv41_jax.optim.optimizer import optimizer


class GroupMemory(NamedTuple):
    label: str
    tensors: int  # parameter tensors in the group
    params: int  # parameter elements
    param_bytes: int
    state_bytes: int  # optimizer state (buffers and counters)


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def abstract_params(model_cfg: ModelConfig) -> nnx.State:
    """Parameters and router biases of ``Transformer(model_cfg)`` as shapes only.

    The biases get no optimizer state (``not_optimized``); they are included so the report lists them.
    """
    from dsv41_jax.model.moe import RouterBias
    from dsv41_jax.model.transformer import abstract_model

    _, params, _ = nnx.split(abstract_model(model_cfg), nnx.Any(nnx.Param, RouterBias), ...)
    return params


def optimizer_memory(model_cfg: ModelConfig, cfg: OptimConfig | None = None,
                     params: nnx.State | None = None) -> list[GroupMemory]:
    """Per label of :mod:`dsv41_jax.optim.labels`: tensors, elements, parameter and optimizer-state bytes."""
    cfg = OptimConfig() if cfg is None else cfg
    params = abstract_params(model_cfg) if params is None else params
    state = jax.eval_shape(optimizer(model_cfg, cfg).init, params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    rows = []
    for label in L.GROUPS:
        mine = [x for path, x in leaves if L.label_of(L.path_name(path)) == label]
        rows.append(GroupMemory(label, len(mine), sum(math.prod(x.shape) for x in mine), _nbytes(mine),
                                _nbytes(state.inner_states[label])))
    return rows


def format_memory_table(rows: list[GroupMemory]) -> str:
    """A Markdown table of :func:`optimizer_memory` with a total line (GB = 1e9 bytes)."""
    lines = ["| group | spec group | tensors | parameters | param GB | state GB | state / param |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in [*rows, GroupMemory("total", *(sum(col) for col in list(zip(*rows, strict=True))[1:]))]:
        spec = L.SPEC_GROUP.get(r.label, "")
        ratio = f"{r.state_bytes / r.param_bytes:.2f}" if r.param_bytes else "-"
        lines.append(f"| {r.label} | {spec} | {r.tensors:,} | {r.params:,} | {r.param_bytes / 1e9:,.3f} | "
                     f"{r.state_bytes / 1e9:,.3f} | {ratio} |")
    return "\n".join(lines)
