"""A small corpus and a tokenizer trained on it, shared by the data-pipeline tests."""

from __future__ import annotations

import pytest

from dsv41_jax import config as C
from dsv41_jax.data.corpus import read_documents
from dsv41_jax.data.tokenizer import engram_consistent, train_tokenizer
from dsv41_jax.engram_hash import build_token_map


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return read_documents("embedded", limit=40)


@pytest.fixture(scope="session")
def trained(corpus, tmp_path_factory):
    """(tokenizer.json path, token map, model config consistent with it)."""
    path = train_tokenizer(corpus, C.tiny(), tmp_path_factory.mktemp("tok") / "tokenizer.json")
    token_map = build_token_map(path)
    return path, token_map, engram_consistent(C.tiny(), token_map)
