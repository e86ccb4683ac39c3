"""``vision:`` section of a run config: image–text data and the stage-3 recipe (spec model §7.4).

Stage 3 of the report trains the main model with the vision encoder frozen except its final norm and the
aligner trainable, at a smaller learning rate than the LLM's (its value is not disclosed): ``freeze_encoder``
and ``lr_mult`` (applied to every trained vision parameter: aligner, span delimiters, ``vision.norm`` and,
when unfrozen, the ViT). Training images are letterboxed to one ``image_size`` square, so every image of a
run has the same patch grid and span (the inference processor keeps the aspect ratio; [OPEN] how the
release batches images of different sizes in training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv41_jax.config import ConfigError
from dsv41_jax.config import build_dataclass as _build

SOURCES = ("synthetic", "folder", "webdataset")


@dataclass(frozen=True)
class VisionTrainConfig:
    source: str = "synthetic"  # synthetic (drawn on the fly) | folder (captions.jsonl + images) | webdataset
    paths: tuple[str, ...] = ()  # folder: directories holding captions.jsonl; webdataset: .tar shards
    image_size: int = 84  # pixels of the square every training image is letterboxed to
    synthetic_examples: int = 1_000_000  # size of the synthetic source (each pair drawn from its index)
    freeze_encoder: bool = True  # stage 3: the ViT is frozen except vision.norm
    lr_mult: float = 0.1  # learning rate of the trained vision parameters, relative to the schedule's
    eval_examples: int = 256  # held-out synthetic pairs for the caption accuracy at the end of a run


def from_dict(data: Any, source: str | None = None) -> VisionTrainConfig:
    cfg = _build(VisionTrainConfig, data if data is not None else {}, VisionTrainConfig(), "vision.", source)
    where = f"{source}: " if source else ""
    if cfg.source not in SOURCES:
        raise ConfigError(f"{where}key 'vision.source' must be one of {', '.join(SOURCES)}, got {cfg.source!r}")
    if cfg.source != "synthetic" and not cfg.paths:
        raise ConfigError(f"{where}key 'vision.paths' must list directories or .tar shards for {cfg.source}")
    for key in ("image_size", "synthetic_examples", "eval_examples"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{where}key 'vision.{key}' must be ≥ 1, got {getattr(cfg, key)}")
    if not cfg.lr_mult >= 0:
        raise ConfigError(f"{where}key 'vision.lr_mult' must be ≥ 0, got {cfg.lr_mult}")
    return cfg
