"""The tokenizer trained on first use: exact vocabulary size, special ids where the model expects them,
lossless byte-level round trip, and an Engram token map consistent with the config (spec model §6.2)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from dsv41_jax import config as C
from dsv41_jax.config import ConfigError
from dsv41_jax.data.tokenizer import load_or_train, special_tokens
from dsv41_jax.engram_hash import EngramHasher, check_token_map


def test_vocab_and_special_ids(trained):
    path, _, cfg = trained
    tok = Tokenizer.from_file(str(path))
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    for name, i in zip(special_tokens(cfg), range(4), strict=True):
        assert tok.token_to_id(name) == i
    assert (tok.token_to_id("<bos>"), tok.token_to_id("<eos>"), tok.token_to_id("<pad>")) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)


def test_byte_level_round_trip(trained):
    tok = Tokenizer.from_file(str(trained[0]))
    text = "def f(x):\n\treturn x ** 2  # ünïcödé ✓ 数\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned


def test_token_map_matches_engram_config(trained):
    _, token_map, cfg = trained
    check_token_map(token_map, cfg.engram)  # raises on a mismatch (spec §6.2 step 4)
    assert list(token_map[:4]) == [0, 1, 2, 3]  # specials first, in order
    assert cfg.engram.compressed_vocab_size < cfg.vocab_size  # case/space variants share an id
    with pytest.raises(ValueError, match="compressed ids"):
        check_token_map(token_map, C.tiny().engram.__class__(**{**C.tiny().engram.__dict__,
                                                                "compressed_vocab_size": 391 + 1000}))
    rows, _ = EngramHasher(cfg.engram, token_map).row_ids(np.arange(4, 40)[None])
    assert rows.shape == (1, 36, 2, cfg.engram.n_columns)


def test_cached_tokenizer_is_reused(trained, tmp_path):
    path, token_map, _ = trained
    cache = tmp_path / "tokenizer.json"
    cache.write_bytes(path.read_bytes())
    got, got_map = load_or_train("train", cache, C.tiny(), texts=iter(()))  # no texts: must not retrain
    assert got == cache and np.array_equal(got_map, token_map)
    with pytest.raises(ConfigError, match="does not exist"):
        load_or_train(str(tmp_path / "missing.json"), cache, C.tiny(), iter(()))
