"""``data.max_documents`` never caps a corpus silently: unset it reads every document; a cap that leaves
documents out warns, naming the key; a cap the corpus fits under says nothing."""

from __future__ import annotations

import json
import warnings

import pytest

from dsv41_jax.data.corpus import CorpusCapped, open_documents


@pytest.fixture
def jsonl(tmp_path) -> str:
    for k in range(2):
        rows = [{"text": f"document {k}.{i}"} for i in range(3)]
        (tmp_path / f"part-{k}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(tmp_path / "*.jsonl")


def test_no_cap_reads_every_document(jsonl):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither unset nor a cap the corpus fits under warns
        assert open_documents("jsonl", (jsonl,)) == [f"document {k}.{i}" for k in range(2) for i in range(3)]
        assert len(open_documents("jsonl", (jsonl,), 6)) == 6


def test_a_cap_that_leaves_documents_out_warns(jsonl):
    with pytest.warns(CorpusCapped, match=r"data\.max_documents = 4 caps the corpus.*data\.max_documents: null"):
        docs = open_documents("jsonl", (jsonl,), 4)
    assert docs == ["document 0.0", "document 0.1", "document 0.2", "document 1.0"]
