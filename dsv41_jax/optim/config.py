"""``OptimConfig``: every number of the V4.1 optimizer and pre-training recipe (spec model §9, §5.3).

Kept apart from the model config: the optimizer and the train loop receive this, the model never does.
Step counts of the schedule come from the report's token budget at the fixed global batch of 100.6 M tokens
(spec §9.4): 28 T / 100.6 M = 278,330; 40 T → 397,614; 45 T → 447,316 steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dsv41_jax.config import ConfigError, build_dataclass, read_yaml


@dataclass(frozen=True)
class OptimConfig:
    # learning-rate schedule, spec §9.4: linear warm-up, constant, cosine decay, constant floor
    lr: float = 2.6e-4
    lr_floor: float = 2.6e-5
    warmup_steps: int = 2000
    constant_until: int = 278_330  # 28 T tokens
    decay_until: int = 397_614  # 40 T tokens
    total_steps: int = 447_316  # 45 T tokens
    # Muon, spec §9.2
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_rms: float = 0.18
    weight_decay: float = 0.1  # decoupled; Muon groups and AdamW norm weights (§9.1)
    ns_coeffs: tuple[float, ...] = (3.4445, -4.7750, 2.0315)
    ns_steps: int = 8
    ns_tail_coeffs: tuple[float, ...] = (2.0, -1.5, 0.5)
    ns_tail_steps: int = 2
    # dtype of the Newton–Schulz iteration: bf16 as Muon's authors and the V4 report run it (X₀ scaled in fp32);
    # float32 for an exact reference
    ns_dtype: str = "bfloat16"
    # guards X₀ = D/‖D‖_F against an all-zero momentum (the indexer gets no LM-loss gradient) [INF]
    ns_eps: float = 1e-20
    # AdamW, spec §9.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-20
    # Sinkhorn-balanced momentum, spec §9.3 (Algorithm 1)
    sinkhorn_momentum: float = 0.95
    sinkhorn_tau: float = 1e-3
    sinkhorn_iters: int = 11
    sinkhorn_eps: float = 1e-20
    sinkhorn_gamma: float = 0.18
    engram_lr_mult: float = 5.0  # Engram tables only; whether wkv/q/k get it too is [OPEN] (§9.1)
    # MoE balance, spec §5.3 / §9.4
    bias_update_speed: float = 1e-3
    seq_balance_alpha: float = 1e-4
    # indexer KL (DeepSeek-V3.2's objective; V4.1's is not published, spec model §9.5): weight, and support
    # `dense` (every entry a query may see) or `topk` (its selection); see dsv41_jax.model.indexer_loss.
    # 0 leaves the indexer at its initialisation (it gets no LM-loss gradient) and skips the extra pass.
    indexer_kl_weight: float = 0.0
    indexer_kl_over: str = "dense"
    # dtype of the momentum buffers (Muon, Sinkhorn, Adam's first moment); Adam's second moment stays fp32
    state_dtype: str = "float32"
    # run each group's update once per set of same-shaped leaves, stacked (dsv41_jax.optim.stacking); null (the
    # default): stacked on GPU and TPU, per leaf on the CPU. At configs/small.yaml on an H100 the stacked update
    # compiles in 17.3 s instead of 22.7 and runs in 148.8 ms instead of 155.0; XLA:CPU compiles it 2× slower
    # (41.2 s against 20.1; BENCHMARKS.md)
    stack_leaves: bool | None = None

    def __post_init__(self):
        validate(self)

    def replace(self, **changes) -> OptimConfig:
        return dataclasses.replace(self, **changes)

    @property
    def ns_schedule(self) -> tuple[tuple[float, float, float], ...]:
        """The (a, b, c) of every Newton–Schulz iteration, in order (8 + 2 by default, spec §9.2)."""
        return (tuple(self.ns_coeffs),) * self.ns_steps + (tuple(self.ns_tail_coeffs),) * self.ns_tail_steps


def validate(c: OptimConfig) -> None:
    """Reject values the optimizer cannot run with; the message names the key."""
    if not 0 <= c.warmup_steps <= c.constant_until <= c.decay_until <= c.total_steps:
        raise ConfigError("need 0 ≤ warmup_steps ≤ constant_until ≤ decay_until ≤ total_steps, got "
                          f"{c.warmup_steps}, {c.constant_until}, {c.decay_until}, {c.total_steps}")
    if not 0 <= c.lr_floor <= c.lr:
        raise ConfigError(f"need 0 ≤ lr_floor ≤ lr, got lr_floor={c.lr_floor}, lr={c.lr}")
    for key in ("muon_momentum", "sinkhorn_momentum", "adam_b1", "adam_b2"):
        if not 0 <= getattr(c, key) < 1:
            raise ConfigError(f"'{key}' must be in [0, 1), got {getattr(c, key)}")
    for key in ("ns_coeffs", "ns_tail_coeffs"):
        if len(getattr(c, key)) != 3:
            raise ConfigError(f"'{key}' must hold three numbers (a, b, c), got {list(getattr(c, key))}")
    if c.ns_steps < 0 or c.ns_tail_steps < 0 or c.ns_steps + c.ns_tail_steps == 0:
        raise ConfigError("'ns_steps' and 'ns_tail_steps' must be ≥ 0 with at least one iteration in total")
    if c.sinkhorn_iters < 1:
        raise ConfigError(f"'sinkhorn_iters' must be ≥ 1, got {c.sinkhorn_iters}")
    if c.indexer_kl_weight < 0:
        raise ConfigError(f"'indexer_kl_weight' must be ≥ 0, got {c.indexer_kl_weight}")
    if c.indexer_kl_over not in ("dense", "topk"):
        raise ConfigError(f"'indexer_kl_over' must be 'dense' or 'topk', got {c.indexer_kl_over!r}")
    if c.ns_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"'ns_dtype' must be 'float32' or 'bfloat16', got {c.ns_dtype!r}")
    if c.state_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"'state_dtype' must be 'float32' or 'bfloat16', got {c.state_dtype!r}")


def from_dict(data: dict, source: str | None = None, prefix: str = "") -> OptimConfig:
    """Strictly build an :class:`OptimConfig` from a dict: unknown keys and wrong types name key and file;
    ``prefix`` (``"optim."`` in a run config) makes them full dotted keys."""
    if isinstance(data, dict) and any(not isinstance(k, str) for k in data):
        raise ConfigError(f"{source or '<dict>'}: optimizer config keys must be strings, got "
                          f"{[k for k in data if not isinstance(k, str)]}")
    try:
        return build_dataclass(OptimConfig, data, OptimConfig(), prefix, source)
    except ConfigError as err:
        if source and not str(err).startswith(f"{source}:"):
            raise ConfigError(f"{source}: {err}") from None
        raise


def load_yaml(path: str | Path, section: str | None = None) -> OptimConfig:
    """Load from YAML (optionally one top-level ``section``, e.g. ``optim`` of a training file)."""
    return from_dict(read_yaml(path, section), source=str(path))
