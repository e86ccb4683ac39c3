"""The ``posttrain:`` section of a run config: QAT + replay-aware fine-tuning (spec attention §7.6, §9.3-9.5).

The fake-quant switches themselves are model keys (``model.attention.cache_quant``); this section says where
the run starts (``init_from``), what it trains on (SFT pairs, optionally mixed with the LM corpus of the
``data:`` section) and how the served path is simulated (``replay``). Strict like the rest of TrainConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv41_jax.config import build_dataclass as _build
from dsv41_jax.config import fail as _fail


@dataclass(frozen=True)
class ReplayConfig:
    """How each SFT row's prompt is served (spec §9): the training forward reproduces the engine's."""

    prob: float = 0.5  # probability that a row's prompt hits the prefix cache (encoder bounded replay, §9.4)
    granularity: int = 1  # hits land on multiples of this (an engine's page size), uniform in [window, N)
    ced: bool = True  # decoder bounded replay at the prompt end: every prefill, hit or not (§9.3)
    cut: int | None = None  # CED cut layer; None = the engines' cut (candidate source + 1; the paper's: source)


@dataclass(frozen=True)
class SFTConfig:
    """Prompt/response pairs, one JSON object per line, under the chat template of ``posttrain.sft``."""

    paths: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    response_key: str = "response"
    # the chat template (see dsv41_jax.posttrain.sft): <bos> user_prefix prompt assistant_prefix | response <eos>
    user_prefix: str = "User: "
    assistant_prefix: str = "\n\nAssistant:"
    max_pairs: int = 100000


@dataclass(frozen=True)
class DistillConfig:
    """Self-distillation toward the exact path (:mod:`.distill`): ``weight · KL(exact ‖ served)`` over the
    response tokens, the teacher being the current weights' exact forward under ``stop_gradient``."""

    weight: float = 0.0  # 0: no teacher forward


@dataclass(frozen=True)
class DrafterConfig:
    """The DSpark drafter kept in step with the fine-tuned backbone (:mod:`.drafter`, spec model §8.5): one
    update of its DSpark loss per step against the step's new weights, no gradient into the backbone."""

    # on when a drafter is found: ``init_from`` below, else the posttrain.init_from checkpoint's own (the mtp.*
    # of a converted checkpoint, or the drafter a post-training run kept in step)
    train: bool = True
    init_from: str = ""  # a drafter.npz (DSpark training's output, `dsv41 train` of a dspark_train config)
    lr: float = 1.0e-3  # peak learning rate; the run's own schedule (optim.warmup_steps, ...) scaled to it
    anchors: int = 16  # anchor positions per row (dsv41_jax.train.dspark)
    ce_weight: float = 1.0
    tv_weight: float = 1.0
    conf_weight: float = 0.5
    position_decay: float = 0.8  # slot i weighs position_decay^i (normalised)


@dataclass(frozen=True)
class PosttrainConfig:
    init_from: str = ""  # a `dsv41 train` run directory or a `dsv41 convert` output (Orbax); required
    sft: SFTConfig = field(default_factory=SFTConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    # loss = (1 − lm_weight)·(response-token CE of the SFT rows) + lm_weight·(CE of the LM corpus rows)
    lm_weight: float = 0.0


def from_dict(data: Any, source: str | None = None) -> PosttrainConfig:
    """Strictly build the section; every error names ``posttrain.<key>`` and ``source``."""
    cfg = _build(PosttrainConfig, data if data is not None else {}, PosttrainConfig(), "posttrain.", source)
    validate(cfg, source)
    return cfg


def validate(cfg: PosttrainConfig, source: str | None = None) -> None:
    r = cfg.replay
    if not cfg.init_from:
        _fail("key 'posttrain.init_from' is required: a `dsv41 train` run directory or a converted checkpoint",
              source)
    if not 0.0 <= r.prob <= 1.0:
        _fail(f"key 'posttrain.replay.prob' must lie in [0, 1], got {r.prob}", source)
    if r.granularity < 1:
        _fail(f"key 'posttrain.replay.granularity' must be ≥ 1, got {r.granularity}", source)
    if cfg.distill.weight < 0.0:
        _fail(f"key 'posttrain.distill.weight' must be ≥ 0, got {cfg.distill.weight}", source)
    if cfg.distill.weight > 0.0 and cfg.lm_weight >= 1.0:
        _fail("key 'posttrain.distill.weight' needs SFT rows (its KL is over response tokens): set "
              "posttrain.lm_weight below 1.0 or the weight to 0", source)
    if not 0.0 <= cfg.lm_weight <= 1.0:
        _fail(f"key 'posttrain.lm_weight' must lie in [0, 1], got {cfg.lm_weight}", source)
    if cfg.lm_weight < 1.0 and not cfg.sft.paths:
        _fail("key 'posttrain.sft.paths' must list jsonl files of prompt/response pairs (or set "
              "posttrain.lm_weight: 1.0 for the LM objective alone)", source)
    if cfg.sft.max_pairs < 1:
        _fail("key 'posttrain.sft.max_pairs' must be ≥ 1", source)
    d = cfg.drafter
    if d.anchors < 1:
        _fail(f"key 'posttrain.drafter.anchors' must be ≥ 1, got {d.anchors}", source)
    if d.lr <= 0.0:
        _fail(f"key 'posttrain.drafter.lr' must be > 0, got {d.lr}", source)
    if not 0.0 < d.position_decay <= 1.0:
        _fail(f"key 'posttrain.drafter.position_decay' must lie in (0, 1], got {d.position_decay}", source)
