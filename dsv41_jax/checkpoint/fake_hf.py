"""``dsv41 make-fake-hf``: a random checkpoint in the exact release format, for any config.

Names, dtypes, shapes and quantisation are the release's (``inventory.expected_inventory``; FP8 via
``quant.quantize_fp8_blocks``, FP4 via ``quant.quantize_fp4_rows``, spec model §2.2), so tests and demos
run the real loading path without the 510 GB download. Magnitudes follow spec model §2.9 (embedding RMS
≈ 0.12, RMSNorm weight means per family) and the golden checkpoint: weights N(0, fan_in^-½), mHC and
router vectors of the sizes the reference's own random model has. ``params`` (our names, float) replaces
the random values where given, e.g. a randomly initialised ``Transformer``.

Layout: safetensors shards of about ``shard_bytes`` each (a quantised pair or a layer's experts never
straddle two), the Engram tables alone in the last shards as in the release (spec model §2.1),
``model.safetensors.index.json`` with ``metadata.total_size``, ``config.json`` from ``to_hf_json`` and a
``tokenizer.json`` whose Engram token map has exactly ``engram.compressed_vocab_size`` keys.
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv41_jax import config as C
from dsv41_jax.checkpoint.inventory import TensorSpec, expected_inventory
from dsv41_jax.checkpoint.plan import _pairs
from dsv41_jax.checkpoint.safetensors import save_file

__all__ = ["byte_level_tokenizer", "write_fake_hf", "write_tokenizer"]

INDEX = "model.safetensors.index.json"
# spec model §2.9 / golden checkpoint: mean of each RMSNorm weight family (others ≈ 1)
_NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
               "indexer.k_norm": 0.5}
_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")  # ids 0, 1, 2 as released


def _random_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float values of one logical tensor (our name; experts stacked [E, out, in])."""
    normal = lambda std, mean=0.0: (mean + std * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    leaf = name.rsplit(".", 2)
    if name in ("embed.weight", "head.weight") or name.startswith("image_"):
        return normal(0.12)
    if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
        mean = next((m for k, m in _NORM_MEANS.items() if name.endswith(f"{k}.weight")), 1.0)
        return normal(0.1 * mean, mean)
    if "hc_" in leaf[-1]:
        kind = leaf[-1].rsplit("_", 1)[1]
        return {"fn": lambda: normal(0.06), "base": lambda: normal(0.5),
                "scale": lambda: np.abs(normal(0.2, 0.5)) + 0.05}[kind]()
    if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
        return normal(0.15 if "gate" in name else 0.5)
    if name.endswith(("q_weight", "k_weight")):
        return normal(0.1, 1.0)
    if name.endswith("engram.embed.weight"):
        return normal(1.0)
    if name.endswith(".bias"):
        return normal(0.02)
    if name.endswith("markov_head.embed.weight"):
        return normal(0.5)
    scale = 3.0 if name.endswith("ffn.gate.weight") else 1.0  # routers are sharper than fan-in (golden)
    return normal(scale * shape[-1] ** -0.5)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])  # per tensor: order-independent


def _encode(name: str, values: np.ndarray, ws: list[TensorSpec], ss: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Logical float values -> the stored tensors of one group (spec model §2.2)."""
    from dsv41_jax import quant

    e8m0 = lambda b: np.asarray(b).view(ml_dtypes.float8_e8m0fnu)  # noqa: E731
    w = ws[0]
    if not ss:
        return {w.name: values.astype(np.float32 if w.dtype == "F32" else ml_dtypes.bfloat16)}
    if w.dtype == "I8":  # routed experts, all of one group at once: [E, out, in] -> packed [E, out, in/2]
        packed, scale = quant.quantize_fp4_rows(values)
        packed, scale = np.asarray(packed).view(np.int8), e8m0(scale)
        return {t.name: packed[e] for e, t in enumerate(ws)} | {t.name: scale[e] for e, t in enumerate(ss)}
    block = (1, 32) if name.endswith("engram.embed.weight") else (32, 32)
    q, scale = quant.quantize_fp8_blocks(values, block=block)
    return {w.name: np.asarray(q), ss[0].name: e8m0(scale)}


def _groups(cfg: C.ModelConfig) -> list[tuple[str, list[TensorSpec], list[TensorSpec], bool]]:
    """Encoding groups in release order, the Engram tables last (each will sit alone in a shard)."""
    groups = list(_pairs(expected_inventory(cfg)))
    return sorted(groups, key=lambda g: g[0].endswith("engram.embed.weight"))  # stable: keeps the rest


def _assign_shards(groups, shard_bytes: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i, (name, ws, ss, _) in enumerate(groups):
        nbytes = sum(t.nbytes for t in ws + ss)
        alone = name.endswith("engram.embed.weight")
        if shards[-1] and (alone or size + nbytes > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
        if alone:
            shards.append([])
            size = 0
    return [s for s in shards if s]


def write_fake_hf(cfg: C.ModelConfig, out: str | Path, *, seed: int = 0,
                  params: Mapping[str, np.ndarray] | None = None, shard_bytes: int = 64 << 20,
                  overwrite: bool = False) -> C.ModelConfig:
    """Write the checkpoint of ``cfg`` into ``out``; returns the config written (compressed vocab adjusted).

    ``out`` must be new or empty (a ConfigError otherwise: random weights would replace a real checkpoint);
    with ``overwrite`` the checkpoint files already there (shards, index, config, tokenizer) are deleted first
    and other files are left alone. Memory: one shard's tensors at a time (plus the group being encoded).
    """
    out = Path(out)
    _prepare_out(out, overwrite)
    cfg = write_tokenizer(cfg, out)
    groups = _groups(cfg)
    shards = _assign_shards(groups, shard_bytes)
    weight_map, total = {}, 0
    for k, members in enumerate(shards):
        shard = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for i in members:
            name, ws, ss, stacked = groups[i]
            shape = ((len(ws),) if stacked else ()) + ((ws[0].shape[0], 2 * ws[0].shape[1]) if ws[0].dtype == "I8"
                                                       else ws[0].shape)
            values = np.asarray(params[name], np.float32) if params and name in params else \
                _random_values(name, shape, _rng(seed, name))
            if values.shape != shape:
                raise ValueError(f"params[{name!r}] has shape {values.shape}; the release format needs {shape}")
            tensors |= _encode(name, values, ws, ss)
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(C.to_hf_json(cfg))
    return cfg


_WRITTEN = ("model-*-of-*.safetensors", INDEX, "config.json", "tokenizer.json", "tokenizer_config.json")


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise C.ConfigError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            what = "holds a checkpoint" if (out / "config.json").exists() else "exists and is not empty"
            raise C.ConfigError(f"--out {out} {what}; random weights would replace it. Choose a new directory, or "
                                "pass --overwrite to replace its checkpoint files")
        for pattern in _WRITTEN:
            for path in out.glob(pattern):
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise C.ConfigError(f"--out {out}: cannot create it ({err.strerror or err})") from err


# ----------------------------------------------------------------------------- tokenizer


def byte_level_tokenizer(vocab_size: int):
    """A valid byte-level BPE tokenizer with exactly ``vocab_size`` ids: the 3 release specials at 0-2, the
    256 byte symbols, then merged strings of lowercase letters and the space symbol, shortest first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(_SPECIALS) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(_SPECIALS) + len(alphabet)} ids a byte-level "
                         "tokenizer needs (3 specials + 256 bytes)")
    vocab = {s: i for i, s in enumerate((*_SPECIALS, *alphabet))}
    letters = [*"abcdefghijklmnopqrstuvwxyz", "Ġ"]  # Ġ: the byte-level symbol of a space
    merges, frontier = [], letters
    while len(vocab) < vocab_size:
        grown = []
        for prefix in frontier:
            for ch in letters:
                if len(vocab) == vocab_size:
                    break
                if prefix + ch not in vocab:
                    vocab[prefix + ch] = len(vocab)
                    merges.append((prefix, ch))
                    grown.append(prefix + ch)
        frontier = grown
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    return tok


def write_tokenizer(cfg: C.ModelConfig, out: Path) -> C.ModelConfig:
    """``out/tokenizer.json`` for ``cfg``; returns ``cfg`` with ``engram.compressed_vocab_size`` equal to the
    number of distinct Engram keys of that tokenizer (spec model §6.2 step 4; the weights do not depend on it).

    The golden checkpoint's tokenizer is reused when its size fits (it is what the tiny config was made
    with); otherwise a byte-level tokenizer of ``vocab_size`` ids is generated.
    """
    from dsv41_jax.engram_hash import build_token_map
    from dsv41_jax.testing import GOLDEN

    golden = GOLDEN / "tiny_hf"
    path = out / "tokenizer.json"
    if (golden / "tokenizer.json").is_file() and _vocab_size(golden / "tokenizer.json") == cfg.vocab_size:
        shutil.copyfile(golden / "tokenizer.json", path)
        shutil.copyfile(golden / "tokenizer_config.json", out / "tokenizer_config.json")
    else:
        byte_level_tokenizer(cfg.vocab_size).save(str(path))
        config = {"bos_token": _SPECIALS[0], "eos_token": _SPECIALS[1], "pad_token": _SPECIALS[2],
                  "add_bos_token": False, "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    n = int(np.unique(build_token_map(path)).size)
    if n != cfg.engram.compressed_vocab_size:
        print(f"make-fake-hf: engram.compressed_vocab_size set to {n} (the tokenizer's distinct Engram keys; "
              f"the config said {cfg.engram.compressed_vocab_size})", file=sys.stderr)
        cfg = cfg.replace(engram=replace(cfg.engram, compressed_vocab_size=n))
    return cfg


def _vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
