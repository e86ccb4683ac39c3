"""The V4.1 optimizer and training-recipe pieces (spec model §9, §5.3).

``optimizer(model_cfg, OptimConfig())`` is one ``optax.GradientTransformation`` for the parameter tree
``nnx.split(model, nnx.Param, ...)``: every parameter is labelled by its checkpoint name
(:func:`label_of`) into Muon (per matrix / head / ``wo_a`` group / expert), Sinkhorn-balanced momentum
(embed, head, Engram tables) or AdamW. Router biases are moved by :func:`router_bias_update` instead.
"""

from dsv41_jax.optim.balance import (
    aux_free_bias_update,
    balance_loss,
    expert_load,
    router_bias_update,
    sequence_balance_loss,
)
from dsv41_jax.optim.config import OptimConfig, from_dict, load_yaml
from dsv41_jax.optim.labels import GROUPS, label_of, param_labels
from dsv41_jax.optim.memory import GroupMemory, format_memory_table, optimizer_memory
from dsv41_jax.optim.muon import newton_schulz, scale_by_muon
from dsv41_jax.optim.optimizer import adamw, group_transforms, muon, opt_state_partition_specs, optimizer, sinkhorn
from dsv41_jax.optim.schedule import lr_at, lr_schedule
from dsv41_jax.optim.sinkhorn import scale_by_sinkhorn, sinkhorn_direction

__all__ = [
    "GROUPS", "GroupMemory", "OptimConfig", "adamw", "aux_free_bias_update", "balance_loss", "expert_load",
    "format_memory_table", "from_dict", "group_transforms", "label_of", "load_yaml", "lr_at", "lr_schedule",
    "muon", "newton_schulz", "opt_state_partition_specs", "optimizer", "optimizer_memory", "param_labels",
    "router_bias_update", "scale_by_muon", "scale_by_sinkhorn", "sequence_balance_loss", "sinkhorn",
    "sinkhorn_direction",
]
