"""``TrainConfig``: one YAML file describes a pre-training run (model, optimizer, mesh, data, checkpoints, logs).

Strict like the model config (ARCHITECTURE.md decision 11): an unknown key, a wrong type or a mesh that the
devices cannot hold is a :class:`ConfigError` that names the key and the file. ``key=value`` overrides use
dotted keys (``optim.lr=1e-3``, ``model.moe.n_routed_experts=16``) and YAML-parsed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dsv41_jax import config as C
from dsv41_jax.config import ConfigError, parse_value, read_yaml
from dsv41_jax.config import build_dataclass as _build
from dsv41_jax.config import fail as _fail
from dsv41_jax.data.pipeline import PACKINGS
from dsv41_jax.optim import OptimConfig
from dsv41_jax.optim import from_dict as optim_from_dict
from dsv41_jax.posttrain.config import PosttrainConfig
from dsv41_jax.posttrain.config import from_dict as posttrain_from_dict
from dsv41_jax.train.guard import ACTIONS, NonFiniteConfig
from dsv41_jax.train.validation import ValidationConfig
from dsv41_jax.vision.config import VisionTrainConfig
from dsv41_jax.vision.config import from_dict as vision_from_dict

MESH_AXES = ("data", "fsdp", "expert", "tensor")
AUTO = -1  # a mesh axis written `auto` takes every device the other axes leave


@dataclass(frozen=True)
class MeshConfig:
    data: int = AUTO
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def shape(self, n_devices: int, source: str | None = None) -> tuple[int, ...]:
        """Axis sizes for ``n_devices`` (``auto`` resolved); a mesh the devices cannot hold is an error."""
        sizes = [getattr(self, a) for a in MESH_AXES]
        fixed = math.prod(s for s in sizes if s != AUTO)
        if AUTO in sizes:
            if n_devices % fixed:
                _fail(f"mesh: the fixed axes use {fixed} devices, which does not divide the {n_devices} "
                      f"devices present (key 'mesh.{MESH_AXES[sizes.index(AUTO)]}' is auto)", source)
            sizes[sizes.index(AUTO)] = n_devices // fixed
        if math.prod(sizes) != n_devices:
            _fail(f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices but "
                  f"{n_devices} are present; set one of mesh.{'/'.join(MESH_AXES)} to auto", source)
        return tuple(sizes)


@dataclass(frozen=True)
class DataConfig:
    # `embedded`: the Python standard library's own .py files (no download); `text`: one document per
    # file; `jsonl`: one document per line, the text under `jsonl_key`; `parquet`: one document per row,
    # the string column `parquet_column`; `arrayrecord`: one document per record, UTF-8 text
    source: str = "embedded"
    paths: tuple[str, ...] = ()
    jsonl_key: str = "text"
    parquet_column: str = "text"
    # cap on the documents read; null (the default): every document of the corpus. A cap that leaves
    # documents out says so when the run starts
    max_documents: int | None = None
    seq_len: int = 64
    # `concat`: concat-then-split, no padding, documents continue across rows; `best_fit` (the release's, spec
    # model §9.4): documents cut into row-long pieces, each put whole into the tightest of `packing_bins` open
    # rows, the rest padding (dsv41_jax/data/pipeline.py)
    packing: str = "concat"
    packing_bins: int = 64
    batch_size: int = 4  # global sequences per optimizer micro-step (split over hosts, then data×fsdp×expert)
    # `train`: train a byte-level BPE on the corpus on first use, cached in the checkpoint directory;
    # otherwise a tokenizer.json path
    tokenizer: str = "train"
    tokenizer_train_documents: int = 300
    # background work that never changes the stream: `read_threads` threads encode documents ahead, in
    # order (0: in the training thread); `prefetch` finished batches wait in a buffer that a background
    # thread fills (0: none)
    read_threads: int = 16
    prefetch: int = 0


@dataclass(frozen=True)
class DistributedConfig:
    """``jax.distributed`` (multi-host). Unset keys fall back to the environment (see ``train/distributed.py``):
    ``DSV41_COORDINATOR`` / ``JAX_COORDINATOR_ADDRESS``, ``DSV41_NUM_PROCESSES`` / ``JAX_NUM_PROCESSES``,
    ``DSV41_PROCESS_ID`` / ``JAX_PROCESS_ID``. Nothing set anywhere: one process, no initialisation."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    auto_detect: bool = False  # let JAX fill unset keys from the cluster (SLURM, Open MPI, TPU, Kubernetes)
    timeout_s: int = 300  # how long to wait for every process to join


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "runs/pretrain_tiny"
    every: int = 50  # steps between saves (0: only the final step)
    keep: int = 3
    # when every checkpoint in dir is damaged the run refuses to start; true: set them aside, start at step 0
    start_fresh: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 1
    jsonl: str | None = None  # default: <checkpoint.dir>/metrics.jsonl
    # TensorBoard event files (the jsonl's scalars) if tensorboardX, torch or tensorflow is installed:
    # `auto` = <checkpoint.dir>/tensorboard, a directory, or null for none
    tensorboard: str | None = "auto"


@dataclass(frozen=True)
class TrainConfig:
    model: C.ModelConfig = field(default_factory=C.tiny)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    steps: int = 100
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    remat: str = "none"  # none | block | dots: rematerialise each transformer block (dots: keep matmuls)
    posttrain: PosttrainConfig | None = None  # QAT + replay fine-tuning (dsv41_jax.posttrain); None: pre-training
    vision: VisionTrainConfig | None = None  # image–text training (dsv41_jax.vision.train); None: text only
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)  # a NaN/inf loss: stop or skip the batch
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # held-out documents and val_loss

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def run_dir(self) -> Path:
        """The local directory the run writes: ``checkpoint.dir``, or its mirror when that is a URI."""
        from dsv41_jax.train.remote import run_directory

        return run_directory(self.checkpoint.dir)

    @property
    def metrics_path(self) -> Path:
        return Path(self.logging.jsonl or self.run_dir / "metrics.jsonl")

    @property
    def tensorboard_dir(self) -> Path | None:
        tb = self.logging.tensorboard
        return None if tb is None else self.run_dir / "tensorboard" if tb == "auto" else Path(tb)


_SECTIONS = {"mesh": MeshConfig, "data": DataConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
             "distributed": DistributedConfig, "nonfinite": NonFiniteConfig, "validation": ValidationConfig}
SOURCES = ("embedded", "text", "jsonl", "parquet", "arrayrecord")
_SCALARS = {"steps": int, "grad_accum": int, "seed": int, "remat": str}


def _mesh_dict(data: Any, source: str | None) -> Any:
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for k, v in data.items():
        if v == "auto":
            out[k] = AUTO
        elif k in MESH_AXES and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            _fail(f"key 'mesh.{k}' must be a positive integer or auto, got {v!r}", source)
    if sum(v == AUTO for v in out.values()) > 1:
        _fail("mesh: at most one axis may be auto", source)
    return out


def from_dict(data: dict, source: str | None = None) -> TrainConfig:
    """Strictly build a :class:`TrainConfig`; every error names the key and ``source``."""
    if not isinstance(data, dict):
        _fail(f"a train config must be a mapping, got {type(data).__name__}", source)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(str(k) for k in set(data) - names)
    if unknown:
        hint = "; ".join(f"did you mean {m[0]}?" for k in unknown if (m := difflib.get_close_matches(k, names, 1)))
        _fail(f"unknown key(s) {', '.join(unknown)}{f' ({hint})' if hint else ''}; valid keys here: "
              f"{', '.join(sorted(names))}", source)
    base = TrainConfig()
    changes: dict[str, Any] = {}
    if "model" in data:
        changes["model"] = C.from_dict(data["model"] or {}, source, prefix="model.")
        if "preset" not in (data["model"] or {}):
            _fail("key 'model.preset' is required (tiny or v41_flash): the other model keys override it", source)
    if "optim" in data:
        changes["optim"] = optim_from_dict(data["optim"] or {}, source, prefix="optim.")
    for key, cls in _SECTIONS.items():
        if key in data:
            sub = _mesh_dict(data[key], source) if key == "mesh" else data[key]
            changes[key] = _build(cls, sub or {}, getattr(base, key), f"{key}.", source)
    if "posttrain" in data:
        changes["posttrain"] = posttrain_from_dict(data["posttrain"], source)
    if "vision" in data:
        changes["vision"] = vision_from_dict(data["vision"], source)
    for key, tp in _SCALARS.items():
        if key in data:
            changes[key] = C.check_type(data[key], tp, key, source)
    cfg = dataclasses.replace(base, **changes)
    validate(cfg, source)
    return cfg


def validate(cfg: TrainConfig, source: str | None = None) -> None:
    d = cfg.data
    if cfg.vision is not None and cfg.posttrain is not None:
        _fail("a run config has a vision section (image–text training) or a posttrain section, not both", source)
    if d.source not in SOURCES:
        _fail(f"key 'data.source' must be one of {', '.join(SOURCES)}, got {d.source!r}", source)
    if d.source != "embedded" and not d.paths:
        _fail(f"key 'data.paths' must list files (or globs) when data.source is {d.source}", source)
    if d.packing not in PACKINGS:
        _fail(f"key 'data.packing' must be one of {', '.join(PACKINGS)}, got {d.packing!r}", source)
    for key, value in (("logging.jsonl", cfg.logging.jsonl), ("logging.tensorboard", cfg.logging.tensorboard)):
        if value is not None and value != "auto" and "://" in str(value):  # pathlib: a local directory 'gs:'
            _fail(f"key '{key}' is a URI ({value!r}): metrics are written to local files; with checkpoint.dir at "
                  "a URI the defaults (null / auto) put them in the run's mirror, and metrics.jsonl is copied to "
                  "the URI", source)
    for key in ("seq_len", "batch_size", "max_documents", "tokenizer_train_documents", "packing_bins"):
        if getattr(d, key) is not None and getattr(d, key) < 1:
            _fail(f"key 'data.{key}' must be ≥ 1, got {getattr(d, key)}", source)
    if d.read_threads < 0 or d.prefetch < 0:
        _fail("keys 'data.read_threads' and 'data.prefetch' must be ≥ 0", source)
    dist = cfg.distributed
    if dist.num_processes is not None and dist.num_processes < 1:
        _fail(f"key 'distributed.num_processes' must be ≥ 1, got {dist.num_processes}", source)
    if dist.process_id is not None and not 0 <= dist.process_id < (dist.num_processes or dist.process_id + 1):
        _fail(f"key 'distributed.process_id' ({dist.process_id}) must lie in [0, num_processes)", source)
    if d.seq_len < 2:
        _fail("key 'data.seq_len' must be ≥ 2 (a token and its target)", source)
    for key in ("steps", "grad_accum"):
        if getattr(cfg, key) < 1:
            _fail(f"key '{key}' must be ≥ 1, got {getattr(cfg, key)}", source)
    if cfg.steps > cfg.optim.total_steps:
        # past total_steps the schedule is flat at lr_floor: a run that long is a schedule written for another
        _fail(f"key 'steps' ({cfg.steps}) is beyond the learning-rate schedule's key 'optim.total_steps' "
              f"({cfg.optim.total_steps}); raise optim.total_steps (with optim.constant_until and "
              f"optim.decay_until) to cover the run, or lower steps", source)
    v = cfg.validation
    if v.documents < 0 or v.every < 1 or v.batches < 1:
        _fail(f"need validation.documents ≥ 0, validation.every ≥ 1 and validation.batches ≥ 1, got {v.documents}, "
              f"{v.every} and {v.batches}", source)
    if v.documents and (cfg.posttrain is not None or cfg.vision is not None):
        _fail("validation.documents applies to pre-training runs (no posttrain: or vision: section)", source)
    if cfg.remat not in ("none", "block", "dots"):
        _fail(f"key 'remat' must be none, block or dots, got {cfg.remat!r}", source)
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1 or cfg.logging.every < 1:
        _fail("need checkpoint.every ≥ 0, checkpoint.keep ≥ 1 and logging.every ≥ 1", source)
    if cfg.nonfinite.action not in ACTIONS or cfg.nonfinite.max_skips < 0:
        _fail(f"key 'nonfinite.action' must be {' or '.join(ACTIONS)} and 'nonfinite.max_skips' ≥ 0, got "
              f"{cfg.nonfinite.action!r} and {cfg.nonfinite.max_skips}", source)
    fixed = math.prod(getattr(cfg.mesh, a) for a in ("data", "fsdp") if getattr(cfg.mesh, a) != AUTO)
    if d.batch_size % fixed:
        _fail(f"key 'data.batch_size' ({d.batch_size}) must be divisible by mesh.data × mesh.fsdp ({fixed}): "
              "the batch is split over both", source)


def _set_dotted(data: dict, dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for i, p in enumerate(parents):
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            _fail(f"override {dotted!r}: '{'.'.join(parents[:i + 1])}' is not a section", source)
        node = nxt
    node[leaf] = value


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load ``path`` and apply ``key=value`` overrides (values parsed as YAML: ``3``, ``1e-3``, ``[1, 2]``)."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        _fail("a train config must be a mapping of sections", str(path))
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r}: expected key=value with a dotted key (optim.lr=1.0e-3)")
        try:
            value = parse_value(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: cannot parse the value: {err}") from err
        _set_dotted(data, key.strip(), value, f"{path} (override {item})")
    source = f"{path} (with overrides {' '.join(overrides)})" if overrides else str(path)
    return from_dict(data, source)
