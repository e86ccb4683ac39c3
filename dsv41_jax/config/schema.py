"""Model configuration: frozen dataclasses, presets, strict YAML and HF ``config.json`` loaders.

The field names follow the reference ``inference/config.json`` (``ModelArgs``) where one exists, grouped
into sub-configs so that each module receives only its own part (spec model §1.2, §1.3).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KERNEL_BACKENDS = ("xla", "pallas")  # = pallas_kernels.*.api.BACKENDS


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent; the message names key and file."""


@dataclass(frozen=True)
class CacheQuant:
    """Which cache formats the training forward fake-quantises (spec attention §7, §7.6).

    All on is the released model: the numerics it was post-trained with and the engine serves (the packed
    cache always stores these formats). Switching one off gives the exact full-precision path for that
    cache, e.g. for pre-training before QAT or as the reference of a served-gap evaluation. Not part of the
    HF ``config.json`` (a training choice, not an architecture value).
    """

    main_kv: bool = True  # NVFP4 (E2M1 + E4M3 per 16) main KV after RoPE (§7.2)
    index: bool = True  # MXFP4 indexer queries and keys (§7.3)
    swa: bool = True  # FP8 E4M3 + UE8M0 per 32 SWA KV (§7.1)


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int = 64
    head_dim: int = 512  # = the shared K/V latent width (MQA, one KV head)
    rope_head_dim: int = 64  # trailing lanes that rotate
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one ratio per layer, backbone layers first, then the DSpark stages (spec attention §1.1)
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_seq_len: int = 65536
    cache_quant: CacheQuant = field(default_factory=CacheQuant)
    # which implementation runs the cache-format and candidate-selection passes (ARCHITECTURE decision 10):
    # "xla" (the jnp reference) or "pallas" (pallas_kernels: Mosaic GPU on GPU, Mosaic TPU on TPU, interpreted
    # on CPU). The kernels are bit-exact on their inputs; around them XLA:GPU may round its neighbouring ops
    # differently (logits within ~1e-6 on the H200). A runtime choice, not part of the HF config.json.
    kernel_backend: str = "xla"

    @property
    def candidate_pool_min(self) -> int:
        # the pinned newest block may hold a single visible entry (spec attention §6.2)
        return self.candidate_topk_blocks * self.candidate_block_size - (self.candidate_block_size - 1)


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0


@dataclass(frozen=True)
class MHCConfig:
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...] = (1, 14)
    num_embeddings: tuple[int, ...] = (384006168, 384016682)
    max_ngram_size: int = 4
    vocab_size: int = 16000000  # the prime search starts below this (spec model §6.3)
    n_heads: int = 8
    head_dim: int = 256
    pad_id: int = 2
    compressed_vocab_size: int = 99092

    @property
    def n_orders(self) -> int:
        return self.max_ngram_size - 1

    @property
    def n_columns(self) -> int:
        return self.n_orders * self.n_heads


@dataclass(frozen=True)
class DSparkConfig:
    n_layers: int = 3
    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256
    n_routed_experts: int = 128
    n_activated_experts: int = 3


@dataclass(frozen=True)
class VisionConfig:
    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_n_token: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    norm_eps: float = 1e-20
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # precision policy: activations in `dtype`, parameters stored in `param_dtype`; mHC mixing, router,
    # norm statistics, softmax and logits are fp32 regardless (spec model §3, §4, §5)
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    # "native" keeps the release's FP8 / packed-FP4 weights with their E8M0 scales and dequantises them on
    # the fly (spec model §2.2, §2.5); "float" holds every weight in param_dtype
    weight_format: str = "float"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mhc: MHCConfig = field(default_factory=MHCConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def __post_init__(self):
        validate(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------------
# validation


def _fail(msg: str, source: str | None = None) -> typing.NoReturn:
    raise ConfigError(f"{source}: {msg}" if source else msg)


def validate(cfg: ModelConfig, source: str | None = None) -> None:
    """Reject impossible topologies with a message that names the offending key."""
    a, n = cfg.attention, cfg.n_layers
    total = n + cfg.dspark.n_layers
    if cfg.dtype not in ("bfloat16", "float32") or cfg.param_dtype not in ("bfloat16", "float32"):
        _fail(f"dtype/param_dtype must be 'bfloat16' or 'float32', got {cfg.dtype!r}/{cfg.param_dtype!r}",
              source)
    if cfg.weight_format not in ("float", "native"):
        _fail(f"weight_format must be 'float' or 'native', got {cfg.weight_format!r}", source)
    if a.kernel_backend not in KERNEL_BACKENDS:
        _fail(f"attention.kernel_backend must be one of {', '.join(map(repr, KERNEL_BACKENDS))}, got "
              f"{a.kernel_backend!r}", source)
    if len(a.compress_ratios) != total:
        _fail(f"attention.compress_ratios has {len(a.compress_ratios)} entries; expected n_layers + "
              f"dspark.n_layers = {total}", source)
    if any(r not in (0, 1, 2) for r in a.compress_ratios):
        _fail(f"attention.compress_ratios must hold only 0, 1 or 2, got {sorted(set(a.compress_ratios))}",
              source)
    if any(r != 0 for r in a.compress_ratios[n:]):
        _fail("attention.compress_ratios: DSpark stages (the entries after n_layers) must be 0", source)
    for key in ("kv_source_layers", "index_source_layers"):
        ids = getattr(a, key)
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
            _fail(f"attention.{key} must be strictly increasing backbone layer ids < {n}, got {list(ids)}",
                  source)
        if any(a.compress_ratios[i] == 0 for i in ids):
            _fail(f"attention.{key} names a pure-SWA layer (ratio 0): {list(ids)}", source)
    if not set(a.kv_source_layers) <= set(a.index_source_layers):
        _fail("attention.kv_source_layers must all be index sources (a KV source owns the index keys)",
              source)
    for layer in range(n):
        m = a.compress_ratios[layer]
        if m == 0:
            continue
        for key in ("kv_source_layers", "index_source_layers"):
            src = [s for s in getattr(a, key) if s <= layer]
            if not src:
                _fail(f"layer {layer} (ratio {m}) comes before any entry of attention.{key}", source)
            if a.compress_ratios[src[-1]] != m:
                _fail(f"layer {layer} has ratio {m} but its attention.{key} entry {src[-1]} has ratio "
                      f"{a.compress_ratios[src[-1]]}", source)
    c = a.candidate_source_layer
    if c not in a.kv_source_layers:
        _fail(f"attention.candidate_source_layer {c} must be one of kv_source_layers {list(a.kv_source_layers)}",
              source)
    if any(s > c for s in a.kv_source_layers):
        _fail("attention.candidate_source_layer must be the last KV source (the decoder's global KV)", source)
    if a.candidate_pool_min < a.index_topk:
        _fail(f"candidate pool too small: candidate_topk_blocks·candidate_block_size − (block − 1) = "
              f"{a.candidate_pool_min} < index_topk = {a.index_topk}", source)
    if a.head_dim % 32 or a.index_head_dim % 32:
        _fail("attention.head_dim and index_head_dim must be multiples of 32 (FP8/MXFP4 groups)", source)
    if a.rope_head_dim % 2 or a.rope_head_dim > min(a.head_dim, a.index_head_dim):
        _fail("attention.rope_head_dim must be even and fit in head_dim and index_head_dim", source)
    if a.n_heads % a.o_groups:
        _fail(f"attention.n_heads {a.n_heads} must be divisible by o_groups {a.o_groups}", source)
    e = cfg.engram
    if len(e.layer_ids) != len(e.num_embeddings) or any(not 0 <= i < n for i in e.layer_ids):
        _fail("engram.layer_ids must be backbone layers, one engram.num_embeddings entry each", source)
    if e.max_ngram_size < 2 or e.head_dim % 32:
        _fail("engram.max_ngram_size must be ≥ 2 and engram.head_dim a multiple of 32", source)
    if any(not 0 <= t < n for t in cfg.dspark.target_layer_ids):
        _fail(f"dspark.target_layer_ids must be backbone layers < {n}", source)
    mo = cfg.moe
    if not 0 < mo.n_activated_experts <= mo.n_routed_experts or mo.n_shared_experts != 1:
        _fail("moe: need 0 < n_activated_experts ≤ n_routed_experts and exactly one shared expert", source)
    if mo.score_func != "sqrtsoftplus":
        _fail(f"moe.score_func {mo.score_func!r} is not supported; V4.1 uses 'sqrtsoftplus'", source)


# ----------------------------------------------------------------------------------------------------
# strict construction from nested dicts (our YAML)


def _check_type(value: Any, tp: Any, key: str, source: str | None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [t for t in typing.get_args(tp) if t is not type(None)][0]
        return _check_type(value, inner, key, source)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            _fail(f"key '{key}' must be a list, got {type(value).__name__} {value!r}", source)
        (inner, _) = typing.get_args(tp)
        return tuple(_check_type(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"key '{key}' must be a number, got {type(value).__name__} {value!r}", source)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"key '{key}' must be an integer, got {type(value).__name__} {value!r}", source)
        return value
    if tp in (str, bool) and not isinstance(value, tp):
        _fail(f"key '{key}' must be {tp.__name__}, got {type(value).__name__} {value!r}", source)
    return value


def _build(cls: type, data: dict, base: Any, prefix: str, source: str | None) -> Any:
    if not isinstance(data, dict):
        _fail(f"key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {type(data).__name__}", source)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        _fail(f"unknown key(s) {', '.join(prefix + k for k in unknown)}; valid keys here: "
              f"{', '.join(sorted(names))}", source)
    changes = {}
    for k, v in data.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            changes[k] = _build(tp, v, getattr(base, k), f"{prefix}{k}.", source)
        else:
            changes[k] = _check_type(v, tp, prefix + k, source)
    if cls is ModelConfig:
        try:
            return dataclasses.replace(base, **changes)
        except ConfigError as err:
            _fail(str(err), source)
    return dataclasses.replace(base, **changes)


def from_dict(data: dict, source: str | None = None) -> ModelConfig:
    """Build a config from a nested dict; ``preset: name`` picks the base the other keys override."""
    if not isinstance(data, dict):
        _fail(f"a model config must be a mapping of keys to values, got {type(data).__name__}", source)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        _fail(f"config keys must be strings, got {bad}", source)
    data = dict(data)
    preset = data.pop("preset", "v41_flash")
    if not isinstance(preset, str) or preset not in PRESETS:
        _fail(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}", source)
    return _build(ModelConfig, data, PRESETS[preset](), "", source)


def read_yaml(path: str | Path, section: str | None = None) -> Any:
    """A YAML document (or one of its top-level sections), with errors that name the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read YAML: {err}") from err
    data = {} if data is None else data
    if section is not None:
        if not isinstance(data, dict) or section not in data:
            raise ConfigError(f"{path}: missing top-level key '{section}'")
        data = data[section]
    return data


def load_yaml(path: str | Path, section: str | None = None) -> ModelConfig:
    """Load a model config from YAML (optionally from one top-level ``section`` such as ``model``)."""
    return from_dict(read_yaml(path, section), source=str(path))


def to_dict(cfg: ModelConfig) -> dict:
    """The nested-dict form accepted by :func:`from_dict` (tuples become lists)."""
    def conv(v):
        return [conv(x) for x in v] if isinstance(v, tuple) else v
    return {k: ({kk: conv(vv) for kk, vv in v.items()} if isinstance(v, dict) else conv(v))
            for k, v in dataclasses.asdict(cfg).items()}


# ----------------------------------------------------------------------------------------------------
# Hugging Face config.json (spec model §1.1, §1.3)

_HF_TEXT = {  # HF text_config key -> (sub-config, our field)
    "vocab_size": (None, "vocab_size"), "hidden_size": (None, "dim"),
    "num_hidden_layers": (None, "n_layers"), "rms_norm_eps": (None, "norm_eps"),
    "moe_intermediate_size": ("moe", "moe_inter_dim"), "n_routed_experts": ("moe", "n_routed_experts"),
    "n_shared_experts": ("moe", "n_shared_experts"), "num_experts_per_tok": ("moe", "n_activated_experts"),
    "scoring_func": ("moe", "score_func"), "routed_scaling_factor": ("moe", "route_scale"),
    "swiglu_limit": ("moe", "swiglu_limit"), "norm_topk_prob": ("moe", "norm_topk_prob"),
    "num_attention_heads": ("attention", "n_heads"), "head_dim": ("attention", "head_dim"),
    "qk_rope_head_dim": ("attention", "rope_head_dim"), "q_lora_rank": ("attention", "q_lora_rank"),
    "o_lora_rank": ("attention", "o_lora_rank"), "o_groups": ("attention", "o_groups"),
    "sliding_window": ("attention", "window_size"), "compress_ratios": ("attention", "compress_ratios"),
    "rope_theta": ("attention", "rope_theta"), "compress_rope_theta": ("attention", "compress_rope_theta"),
    "kv_source_layer_ids": ("attention", "kv_source_layers"),
    "index_source_layer_ids": ("attention", "index_source_layers"),
    "candidate_source_layer_id": ("attention", "candidate_source_layer"),
    "candidate_topk_blocks": ("attention", "candidate_topk_blocks"),
    "candidate_block_size": ("attention", "candidate_block_size"),
    "index_n_heads": ("attention", "index_n_heads"), "index_head_dim": ("attention", "index_head_dim"),
    "index_topk": ("attention", "index_topk"),
    "hc_mult": ("mhc", "hc_mult"), "hc_sinkhorn_iters": ("mhc", "hc_sinkhorn_iters"), "hc_eps": ("mhc", "hc_eps"),
    "engram_layer_ids": ("engram", "layer_ids"), "engram_num_embeddings": ("engram", "num_embeddings"),
    "engram_max_ngram_size": ("engram", "max_ngram_size"), "engram_vocab_size": ("engram", "vocab_size"),
    "engram_n_heads": ("engram", "n_heads"), "engram_head_dim": ("engram", "head_dim"),
    "engram_pad_token_id": ("engram", "pad_id"),
    "engram_compressed_vocab_size": ("engram", "compressed_vocab_size"),
    "num_nextn_predict_layers": ("dspark", "n_layers"), "dspark_block_size": ("dspark", "block_size"),
    "dspark_noise_token_id": ("dspark", "noise_token_id"),
    "dspark_target_layer_ids": ("dspark", "target_layer_ids"), "dspark_markov_rank": ("dspark", "markov_rank"),
    "dspark_n_routed_experts": ("dspark", "n_routed_experts"),
    "dspark_num_experts_per_tok": ("dspark", "n_activated_experts"),
}
_HF_ROPE = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
            "original_max_position_embeddings": "original_seq_len"}
_HF_VISION = {"num_hidden_layers": "n_layers", "hidden_size": "dim", "num_attention_heads": "n_heads",
              "intermediate_size": "inter_dim", "patch_size": "patch_size", "rope_theta": "rope_theta",
              "downsample_ratio": "downsample_ratio", "max_image_tokens": "max_n_token",
              "min_pixels": "min_pixels", "max_wh_ratio": "max_wh_ratio"}
# HF keys that describe no freedom of this architecture: they must carry the release's value
_HF_TEXT_FIXED = {"model_type": "deepseek_v41_text", "hidden_act": "silu", "attention_bias": False,
                  "attention_dropout": 0.0, "tie_word_embeddings": False, "num_key_value_heads": 1,
                  "topk_method": "noaux_tc"}
_HF_TEXT_FREE = {"initializer_range", "use_cache", "max_position_embeddings", "rope_scaling"}
_HF_TEXT_IGNORED = set(_HF_TEXT_FIXED) | _HF_TEXT_FREE
_HF_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_HF_TOP = {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"}
_HF_TOP_IGNORED = {"architectures", "model_type", "dtype", "transformers_version", "quantization_config",
                   "text_config", "vision_config"}


def from_hf(hf: dict | str | Path, **overrides) -> ModelConfig:
    """Build a config from a released HF ``config.json`` (a dict, the file, or its directory)."""
    source = None
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        source = str(path)
        hf = json.loads(path.read_text())
    text = hf.get("text_config", hf)
    unknown = sorted(set(text) - set(_HF_TEXT) - _HF_TEXT_IGNORED)
    unknown += sorted(set(hf) - _HF_TOP - _HF_TOP_IGNORED) if "text_config" in hf else []
    if unknown:
        _fail(f"unknown HF config key(s): {unknown}", source)
    for key, want in _HF_TEXT_FIXED.items():
        if key in text and text[key] != want:
            _fail(f"text_config.{key} = {text[key]!r} is not supported (DeepSeek-V4.1 has {want!r})", source)
    quant = hf.get("quantization_config")
    if quant is not None and quant != _HF_QUANT:
        _fail(f"quantization_config {quant} is not the release format {_HF_QUANT}", source)
    nested: dict[str, Any] = {k: {} for k in ("attention", "moe", "mhc", "engram", "dspark")}
    for key, (sub, name) in _HF_TEXT.items():
        if key in text:
            (nested[sub] if sub else nested)[name] = text[key]
    rope = text.get("rope_scaling") or {}
    if rope and rope.get("rope_type") != "yarn":
        _fail(f"rope_scaling.rope_type must be 'yarn', got {rope.get('rope_type')!r}", source)
    unknown_rope = sorted(set(rope) - set(_HF_ROPE) - {"rope_type"})
    if unknown_rope:
        _fail(f"unknown rope_scaling key(s): {unknown_rope}", source)
    for key, name in _HF_ROPE.items():
        if key in rope:
            nested["attention"][name] = rope[key]
    for key in _HF_TOP:
        if key in hf:
            nested[key] = hf[key]
    if "vision_config" in hf:
        vis = {k: v for k, v in hf["vision_config"].items() if k != "model_type"}
        bad = sorted(set(vis) - set(_HF_VISION))
        if bad:
            _fail(f"unknown HF vision_config key(s): {bad}", source)
        nested["vision"] = {_HF_VISION[k]: v for k, v in vis.items()}
    try:
        cfg = _build(ModelConfig, nested, ModelConfig(), "", None)
    except ConfigError as err:
        _fail(_hf_spelling(str(err)), source)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _hf_spelling(message: str) -> str:
    """Name keys in an error as the HF file spells them (``hidden_size``, not our ``dim``)."""
    names = {(f"{sub}.{name}" if sub else name): f"text_config.{key}" for key, (sub, name) in _HF_TEXT.items()}
    names |= {f"attention.{name}": f"text_config.rope_scaling.{key}" for key, name in _HF_ROPE.items()}
    names |= {f"vision.{name}": f"vision_config.{key}" for key, name in _HF_VISION.items()}
    for ours in sorted(names, key=len, reverse=True):
        message = message.replace(f"'{ours}'", f"'{names[ours]}'")
    return message


def to_hf(cfg: ModelConfig) -> dict:
    """The HF composite ``config.json`` dict, in the release's key order (spec model Appendix A)."""
    a, mo, mh, e, d, v = cfg.attention, cfg.moe, cfg.mhc, cfg.engram, cfg.dspark, cfg.vision

    def num(x):  # the release writes integral floats as ints except where it writes 10.0
        return int(x) if float(x).is_integer() else x

    text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    for key, (sub, name) in list(_HF_TEXT.items()):
        val = getattr(getattr(cfg, sub) if sub else cfg, name)
        text[key] = list(val) if isinstance(val, tuple) else val
    order = ["model_type", "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
             "o_lora_rank", "o_groups",
             "hidden_act", "swiglu_limit", "rms_norm_eps", "attention_bias", "attention_dropout",
             "initializer_range", "use_cache", "tie_word_embeddings", "max_position_embeddings", "rope_theta",
             "rope_scaling", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "scoring_func",
             "topk_method", "norm_topk_prob", "routed_scaling_factor", "sliding_window", "compress_ratios",
             "compress_rope_theta", "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads",
             "index_head_dim", "index_topk", "candidate_source_layer_id", "candidate_topk_blocks",
             "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
             "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
             "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
             "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id",
             "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
             "dspark_num_experts_per_tok"]
    text |= {"num_key_value_heads": 1, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
             "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False,
             "max_position_embeddings": 1048576, "topk_method": "noaux_tc",
             "rope_theta": num(a.rope_theta), "compress_rope_theta": num(a.compress_rope_theta),
             "rope_scaling": {"rope_type": "yarn", "factor": num(a.rope_factor), "beta_fast": num(a.beta_fast),
                              "beta_slow": num(a.beta_slow), "original_max_position_embeddings": a.original_seq_len}}
    vision = {"model_type": "deepseek_v41_vision"} | {k: num(getattr(v, n)) if isinstance(getattr(v, n), float)
                                                        else getattr(v, n) for k, n in _HF_VISION.items()}
    del mo, mh, e, d
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "transformers_version": "5.6.0", "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, "image_token_id": cfg.image_token_id,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "text_config": {k: text[k] for k in order}, "vision_config": vision}


def to_hf_json(cfg: ModelConfig) -> str:
    return json.dumps(to_hf(cfg), indent=2) + "\n"


# ----------------------------------------------------------------------------------------------------
# presets


def v41_flash() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash (spec model §1.1)."""
    return ModelConfig()


def tiny() -> ModelConfig:
    """Every layer role of the release at toy width; equals the golden checkpoint's config.

    Window (8) < top-k (16) < candidate pool (29) < visible entries at a few hundred tokens, so every
    selection binds in tests.
    """
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=12, image_token_id=3,
        attention=AttentionConfig(
            n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
            window_size=8, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
            kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8, 10), candidate_source_layer=6,
            candidate_topk_blocks=8, candidate_block_size=4, index_n_heads=16, index_head_dim=64, index_topk=16),
        moe=MoEConfig(n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64),
        engram=EngramConfig(layer_ids=(1, 4), num_embeddings=(434, 606), vocab_size=61, n_heads=2, head_dim=32,
                            compressed_vocab_size=391),
        dspark=DSparkConfig(noise_token_id=500, target_layer_ids=(9, 10, 11), markov_rank=32,
                            n_routed_experts=4, n_activated_experts=3),
        vision=VisionConfig(n_layers=1, dim=64, n_heads=2, inter_dim=96),
    )


PRESETS = {"v41_flash": v41_flash, "tiny": tiny}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
