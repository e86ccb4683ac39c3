"""A byte-level BPE tokenizer trained on the corpus on first use, and the Engram token map that goes with it.

Special tokens take the ids the model config expects (BOS 0, EOS 1, PAD 2, image 3 in the tiny preset), then
the 256 byte symbols, then merges up to ``vocab_size``. Byte-level means every text encodes (no unknown
token) and single-id decoding of a byte that is part of a multi-byte character yields U+FFFD, which the
Engram compression keys by its raw token string (spec model §6.2 step 2).

Engram consistency (spec model §6.2 step 4): the compressed vocabulary is a property of the tokenizer, not a
free choice, so :func:`engram_consistent` sets ``engram.compressed_vocab_size`` to the number of distinct
keys of the trained tokenizer's map. The hash primes depend only on ``engram.vocab_size`` (§6.3), so table
sizes are unchanged; only the multipliers (§6.4) follow the new count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.engram_hash import build_token_map, check_token_map


def special_tokens(cfg: ModelConfig) -> list[str]:
    """Names of the special tokens in id order; ids must be 0..n-1 so the BPE trainer places them there."""
    named = {cfg.bos_token_id: "<bos>", cfg.eos_token_id: "<eos>", cfg.pad_token_id: "<pad>",
             cfg.image_token_id: "<image>"}
    if sorted(named) != list(range(len(named))):
        raise ConfigError(f"tokenizer training needs the special ids (bos/eos/pad/image) to be 0..{len(named) - 1}, "
                          f"got {sorted(named)}; pass a tokenizer.json instead")
    return [named[i] for i in range(len(named))]


def train_tokenizer(texts: Iterable[str], cfg: ModelConfig, out: str | Path) -> Path:
    """Train a byte-level BPE with exactly ``cfg.vocab_size`` ids and write ``out`` (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = special_tokens(cfg)
    if cfg.vocab_size < len(specials) + 256:
        raise ConfigError(f"model.vocab_size {cfg.vocab_size} is smaller than the 256 bytes + specials of a "
                          "byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != cfg.vocab_size:
        raise ConfigError(f"the corpus yields only {n} BPE ids, fewer than model.vocab_size {cfg.vocab_size}; "
                          "use more data.tokenizer_train_documents")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(out)  # atomic: a killed run never leaves a half-written tokenizer behind
    return out


def engram_consistent(cfg: ModelConfig, token_map: np.ndarray) -> ModelConfig:
    """``cfg`` with ``engram.compressed_vocab_size`` taken from ``token_map`` (checked afterwards)."""
    n = int(np.unique(token_map).size)
    cfg = dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, compressed_vocab_size=n))
    check_token_map(token_map, cfg.engram)
    return cfg


def load_or_train(spec: str, cache: Path, cfg: ModelConfig, texts: Iterable[str]) -> tuple[Path, np.ndarray]:
    """The tokenizer path (trained into ``cache`` when ``spec`` is ``train`` and none is cached; copied into it
    when ``spec`` is a URI, so the run directory holds the tokenizer it trains with) and its map."""
    if spec != "train" and "://" in spec:
        from etils import epath

        try:
            data = epath.Path(spec).read_bytes()
        except Exception as err:  # missing, no file-system package for the scheme, credentials, network
            raise ConfigError(f"data.tokenizer: cannot read {spec} ({type(err).__name__}: {err})") from err
        if cache.exists() and cache.read_bytes() != data:  # the run's own tokenizer is never replaced
            raise ConfigError(f"data.tokenizer {spec} differs from the tokenizer this run was started with, {cache}; "
                              "point data.tokenizer at that file, or start a new checkpoint.dir")
        if not cache.exists():
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(cache)
        spec = str(cache)
    path = cache if spec == "train" else Path(spec)
    if spec == "train" and not path.exists():
        train_tokenizer(texts, cfg, path)
    if not path.exists():
        raise ConfigError(f"data.tokenizer: {path} does not exist")
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise ConfigError(f"data.tokenizer {path} has {n} ids but model.vocab_size is {cfg.vocab_size}")
    return path, build_token_map(path)
