"""The whole-model V4.1 optimizer: one ``optax.GradientTransformation`` partitioned by group (spec model §9.1).

Every group ends in ``scale_by_learning_rate`` of the same schedule (spec §9.4), so ``optax.apply_updates``
gives ``W ← W·(1 − η·λ) − η·O`` for Muon and ``W ← W − γ·η·lr_mult·Δ`` for the Sinkhorn tables.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dsv41_jax.config import ModelConfig
from dsv41_jax.optim import labels as L
from dsv41_jax.optim.config import OptimConfig
from dsv41_jax.optim.muon import scale_by_muon
from dsv41_jax.optim.schedule import lr_schedule
from dsv41_jax.optim.sinkhorn import scale_by_sinkhorn
from dsv41_jax.optim.stacking import stack_leaves


def muon(cfg: OptimConfig, blocks: int = 1, lr: optax.ScalarOrSchedule | None = None) -> optax.GradientTransformation:
    """Muon (spec §9.2) with decoupled weight decay, orthogonalising each of ``blocks`` row blocks apart."""
    return optax.chain(
        scale_by_muon(momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, schedule=cfg.ns_schedule,
                      rms=cfg.muon_rms, eps=cfg.ns_eps, blocks=blocks, state_dtype=jnp.dtype(cfg.state_dtype),
                      ns_dtype=cfg.ns_dtype),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(lr_schedule(cfg) if lr is None else lr))


def sinkhorn(cfg: OptimConfig, lr_mult: float = 1.0,
             lr: optax.ScalarOrSchedule | None = None) -> optax.GradientTransformation:
    """Sinkhorn-balanced momentum (spec §9.3): step γ·lr·lr_mult, no weight decay."""
    return optax.chain(
        scale_by_sinkhorn(momentum=cfg.sinkhorn_momentum, tau=cfg.sinkhorn_tau, iters=cfg.sinkhorn_iters,
                          eps=cfg.sinkhorn_eps, state_dtype=jnp.dtype(cfg.state_dtype)),
        optax.scale(cfg.sinkhorn_gamma * lr_mult),
        optax.scale_by_learning_rate(lr_schedule(cfg) if lr is None else lr))


def adamw(cfg: OptimConfig, weight_decay: float, lr: optax.ScalarOrSchedule | None = None,
          ) -> optax.GradientTransformation:
    """AdamW with bias correction, β 0.9/0.95, ε 1e-20 added to sqrt(v̂) (spec §9.1)."""
    return optax.chain(
        optax.scale_by_adam(b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, mu_dtype=jnp.dtype(cfg.state_dtype)),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(lr_schedule(cfg) if lr is None else lr))


def stacked(cfg: OptimConfig) -> bool:
    """Whether the groups' transforms run on stacked leaves: ``cfg.stack_leaves``, or where it is None, off the CPU
    (stacking compiles faster and runs a little faster on a GPU, yet compiles 2× slower on XLA:CPU)."""
    return cfg.stack_leaves if cfg.stack_leaves is not None else jax.default_backend() != "cpu"


def group_transforms(model_cfg: ModelConfig, cfg: OptimConfig,
                     lr: optax.ScalarOrSchedule | None = None) -> dict[str, optax.GradientTransformation]:
    """The transform of every label of :mod:`dsv41_jax.optim.labels` (``lr`` overrides the schedule), each run
    on stacked groups of same-shaped leaves where :func:`stacked` says so (:mod:`dsv41_jax.optim.stacking`)."""
    a = model_cfg.attention
    wrap = stack_leaves if stacked(cfg) else (lambda tx: tx)
    return {
        L.MUON: wrap(muon(cfg, 1, lr)),
        L.MUON_Q_HEADS: wrap(muon(cfg, a.n_heads, lr)),
        L.MUON_INDEX_HEADS: wrap(muon(cfg, a.index_n_heads, lr)),
        L.MUON_OUT_GROUPS: wrap(muon(cfg, a.o_groups, lr)),
        L.SINKHORN: wrap(sinkhorn(cfg, 1.0, lr)),
        L.SINKHORN_ENGRAM: wrap(sinkhorn(cfg, cfg.engram_lr_mult, lr)),
        L.ADAMW: wrap(adamw(cfg, cfg.weight_decay, lr)),
        L.ADAMW_NO_DECAY: wrap(adamw(cfg, 0.0, lr)),
        L.NOT_OPTIMIZED: optax.set_to_zero(),
    }


def optimizer(model_cfg: ModelConfig, cfg: OptimConfig | None = None,
              lr: optax.ScalarOrSchedule | None = None) -> optax.GradientTransformation:
    """The V4.1 optimizer for a parameter tree named like the checkpoint (``nnx.split(model, nnx.Param, ...)``).

    Router biases are not ``nnx.Param``; if a tree that holds them is passed, they get zero updates.
    """
    cfg = OptimConfig() if cfg is None else cfg
    return optax.partition(group_transforms(model_cfg, cfg, lr), L.param_labels)


def opt_state_partition_specs(tx: optax.GradientTransformation, params: Any, param_specs: Any) -> Any:
    """PartitionSpecs for ``tx.init(params)``: every per-parameter buffer shards like its parameter.

    ``params`` may be abstract; ``param_specs`` is a tree like ``params`` with a ``PartitionSpec`` per leaf
    (``dsv41_jax.sharding.state_partition_specs``). Counters and other scalars are replicated. A state leaf
    belongs to a parameter when its path ends with that parameter's path and it has the same shape.
    """
    is_spec = lambda x: isinstance(x, P)
    by_path = {tuple(path): (spec, leaf.shape) for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_specs, is_leaf=is_spec),
        strict=True)}
    lengths = sorted({len(p) for p in by_path}, reverse=True)
    state = jax.eval_shape(tx.init, params)

    def spec_of(path, leaf):
        for n in lengths:
            hit = by_path.get(tuple(path[-n:])) if len(path) >= n else None
            if hit is not None and tuple(hit[1]) == tuple(leaf.shape):
                return hit[0]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, state)
