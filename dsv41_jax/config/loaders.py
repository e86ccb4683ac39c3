"""Strict loaders: nested dicts and YAML files (our format), HF ``config.json`` (the release's), and back.

Every unknown key, wrong type or impossible value is a :class:`ConfigError` that names the key and the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dsv41_jax.config.presets import PRESETS
from dsv41_jax.config.schema import ConfigError, ModelConfig, fail

# ----------------------------------------------------------------------------------------------------
# strict construction from nested dicts (our YAML)


def check_type(value: Any, tp: Any, key: str, source: str | None) -> Any:
    """``value`` as the annotation ``tp`` wants it (ints accepted as floats, lists as tuples), or a
    :class:`ConfigError` naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [t for t in typing.get_args(tp) if t is not type(None)][0]
        return check_type(value, inner, key, source)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(f"key '{key}' must be a list, got {type(value).__name__} {value!r}", source)
        (inner, _) = typing.get_args(tp)
        return tuple(check_type(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(f"key '{key}' must be a number, got {type(value).__name__} {value!r}", source)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(f"key '{key}' must be an integer, got {type(value).__name__} {value!r}", source)
        return value
    if tp in (str, bool) and not isinstance(value, tp):
        fail(f"key '{key}' must be {tp.__name__}, got {type(value).__name__} {value!r}", source)
    return value


def build_dataclass(cls: type, data: dict, base: Any, prefix: str, source: str | None) -> Any:
    """``base`` with the keys of ``data`` replaced, recursing into sub-configs; ``prefix`` dots the key
    names in error messages (``"moe."``). Unknown keys and wrong types are a :class:`ConfigError`."""
    if not isinstance(data, dict):
        fail(f"key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {type(data).__name__}", source)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        close = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        hint = "; ".join(f"did you mean {prefix}{m[0]}?" for k, m in close.items() if m)
        fail(f"unknown key(s) {', '.join(prefix + k for k in unknown)}{f' ({hint})' if hint else ''}; valid keys "
             f"here: {', '.join(sorted(names))}", source)
    changes = {}
    for k, v in data.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            changes[k] = build_dataclass(tp, v, getattr(base, k), f"{prefix}{k}.", source)
        else:
            changes[k] = check_type(v, tp, prefix + k, source)
    try:  # a config's own checks of ranges and relations (its __post_init__), named by the section
        return dataclasses.replace(base, **changes)
    except ConfigError as err:
        section = prefix.rstrip(".")
        fail(f"{section}: {err}" if section else str(err), source)


def from_dict(data: dict, source: str | None = None, prefix: str = "") -> ModelConfig:
    """Build a config from a nested dict; ``preset: name`` picks the base the other keys override. ``prefix``
    (``"model."`` in a run config) makes every key in an error message the full dotted key."""
    if not isinstance(data, dict):
        fail(f"a model config must be a mapping of keys to values, got {type(data).__name__}", source)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        fail(f"config keys must be strings, got {bad}", source)
    data = dict(data)
    preset = data.pop("preset", "v41_flash")
    if not isinstance(preset, str) or preset not in PRESETS:
        fail(f"key '{prefix}preset': unknown preset {preset!r}; choose one of {sorted(PRESETS)}", source)
    return build_dataclass(ModelConfig, data, PRESETS[preset](), prefix, source)


class _StrictLoader(yaml.SafeLoader):
    """``safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently) and
    reads ``1e-3`` as a number: YAML 1.1's float pattern wants a decimal point and a signed exponent, so
    PyYAML returns ``1e-3`` and ``2E5`` as strings; YAML 1.2 (and every other reader) takes them as floats."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (also on line "
                                  f"{seen[key]}); a config keeps one value per key")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float (core schema) besides 1.1's: a mantissa with or without a point, an exponent with or
# without a sign. Registered on the resolver's first characters as PyYAML's own float resolver is.
_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)$")
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+.0123456789"))


def parse_value(text: str) -> Any:
    """One YAML value as the config files read it (``key=value`` overrides): ``3``, ``1e-3``, ``[1, 2]``."""
    return yaml.load(text, Loader=_StrictLoader)


def read_yaml(path: str | Path, section: str | None = None) -> Any:
    """The YAML document of a config file (or one of its top-level sections), with one-line errors that name
    the file: unreadable, not YAML, empty, several documents, or a key given twice."""
    path = Path(path)
    try:
        docs = list(yaml.load_all(path.read_text(), Loader=_StrictLoader))
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a text file ({err.reason} at byte {err.start})") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") from err
    docs = [d for d in docs if d is not None]
    if not docs:
        raise ConfigError(f"{path}: the file is empty (or only comments); a config needs its keys")
    if len(docs) > 1:
        raise ConfigError(f"{path}: holds {len(docs)} YAML documents (separated by '---'); a config is one document")
    data = docs[0]
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
        try:
            hf = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config: {getattr(err, 'strerror', None) or err}") from err
        if not isinstance(hf, dict):
            fail(f"expected a JSON object of config keys, got {type(hf).__name__}", source)
    text = hf.get("text_config", hf)
    unknown = sorted(set(text) - set(_HF_TEXT) - _HF_TEXT_IGNORED)
    unknown += sorted(set(hf) - _HF_TOP - _HF_TOP_IGNORED) if "text_config" in hf else []
    if unknown:
        fail(f"unknown HF config key(s): {unknown}", source)
    for key, want in _HF_TEXT_FIXED.items():
        if key in text and text[key] != want:
            fail(f"text_config.{key} = {text[key]!r} is not supported (DeepSeek-V4.1 has {want!r})", source)
    quant = hf.get("quantization_config")
    if quant is not None and quant != _HF_QUANT:
        fail(f"quantization_config {quant} is not the release format {_HF_QUANT}", source)
    nested: dict[str, Any] = {k: {} for k in ("attention", "moe", "mhc", "engram", "dspark")}
    for key, (sub, name) in _HF_TEXT.items():
        if key in text:
            (nested[sub] if sub else nested)[name] = text[key]
    rope = text.get("rope_scaling") or {}
    if rope and rope.get("rope_type") != "yarn":
        fail(f"rope_scaling.rope_type must be 'yarn', got {rope.get('rope_type')!r}", source)
    unknown_rope = sorted(set(rope) - set(_HF_ROPE) - {"rope_type"})
    if unknown_rope:
        fail(f"unknown rope_scaling key(s): {unknown_rope}", source)
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
            fail(f"unknown HF vision_config key(s): {bad}", source)
        nested["vision"] = {_HF_VISION[k]: v for k, v in vis.items()}
    try:
        cfg = build_dataclass(ModelConfig, nested, ModelConfig(), "", None)
    except ConfigError as err:
        fail(_hf_spelling(str(err)), source)
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
