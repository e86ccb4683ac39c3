"""Packing: segment ids and positions describe the documents exactly, Engram rows are each document's own
hash (spec model §6.5), the order is deterministic, per-host shards are disjoint, and the iterator state
resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from dsv41_jax.data.pipeline import loss_mask, packed_dataset
from dsv41_jax.engram_hash import EngramHasher

S, B = 48, 3


@pytest.fixture(scope="module")
def docs(corpus) -> list[str]:
    """Short documents (several per row) mixed with long ones (split over rows)."""
    return [f"value_{i} = {i} * {i}  # item {i}\n" * (1 + i % 3) for i in range(40)] + corpus[:4]


@pytest.fixture(scope="module")
def make(docs, trained):
    path, token_map, cfg = trained

    def make(**kw):
        args = dict(seq_len=S, batch_size=B, seed=0) | kw
        return packed_dataset(docs, path, cfg, token_map, **args)

    return make


@pytest.fixture(scope="module")
def encoded(docs, trained):
    """Every document as the pipeline tokenizes it: [BOS] + ids + [EOS]."""
    tok = Tokenizer.from_file(str(trained[0]))
    cfg = trained[2]
    return [(cfg.bos_token_id, *tok.encode(d, add_special_tokens=False).ids, cfg.eos_token_id) for d in docs]


def _batches(it, n):
    return [next(it) for _ in range(n)]


def test_segments_and_positions(make, encoded, trained):
    cfg, hasher = trained[2], EngramHasher(trained[2].engram, trained[1])
    whole = {tuple(d) for d in encoded}
    complete = 0
    for batch in _batches(iter(make()), 20):
        assert batch["tokens"].shape == (B, S) and batch["engram_rows"].shape == (B, S, 2, cfg.engram.n_columns)
        for tok, seg, pos, rows in zip(batch["tokens"], batch["segment_ids"], batch["positions"],
                                       batch["engram_rows"], strict=True):
            ids = [s for s in np.unique(seg) if s > 0]
            assert ids == list(range(1, len(ids) + 1))  # numbered from 1 in order
            assert np.all(np.diff(seg) >= 0) if 0 not in seg else np.all(seg[np.argmax(seg == 0):] == 0)
            for s in ids:
                where = np.flatnonzero(seg == s)
                assert np.array_equal(pos[where], np.arange(len(where)))  # contiguous, restart at 0
                piece = tuple(tok[where])
                if piece[0] == cfg.bos_token_id and piece[-1] == cfg.eos_token_id:
                    assert piece in whole  # a whole document, unchanged
                    want, _ = hasher.row_ids(np.asarray(piece)[None])  # its own hash, fresh history
                    assert np.array_equal(rows[where], want[0])
                    complete += 1
            assert np.all(tok[seg == 0] == 0) and np.all(pos[seg == 0] == 0)  # padding
    assert complete > 0


def test_loss_mask_stops_at_document_ends():
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    want = np.array([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
    assert np.array_equal(loss_mask(seg), want)


def test_deterministic(make):
    a, b = _batches(iter(make()), 4), _batches(iter(make()), 4)
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    c = next(iter(make(seed=1)))
    assert not np.array_equal(a[0]["tokens"], c["tokens"])


def test_iterator_state_round_trip(make):
    it = iter(make())
    _batches(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
    want = _batches(it, 3)
    resumed = iter(make())
    resumed.set_state(state)
    for x, y in zip(want, _batches(resumed, 3), strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_hosts_get_disjoint_halves(make):
    firsts = []
    for host in range(2):
        batch = next(iter(make(batch_size=4, process_index=host, process_count=2)))
        assert batch["tokens"].shape == (2, S)  # the global batch split over the hosts
        firsts.append({tuple(r[:8]) for r in batch["tokens"]})
    assert not firsts[0] & firsts[1]  # every host reads its own documents


def test_best_fit_rows_hold_whole_pieces(make, encoded, trained):
    """data.packing=best_fit: every segment is a whole row-long piece of one document (documents cut at
    multiples of S, spec model §9.4), its Engram rows the whole document's hash at that offset; padding
    is the rest of a row; the iterator state resumes exactly."""
    hasher = EngramHasher(trained[2].engram, trained[1])
    pieces = {tuple(d[i:i + S]): (n, i) for n, d in enumerate(encoded) for i in range(0, len(d), S)}
    rows_of = {}
    it = iter(make(packing="best_fit", packing_bins=4))
    seen, used = set(), 0
    for batch in _batches(it, 12):
        for tok, seg, pos, rows in zip(batch["tokens"], batch["segment_ids"], batch["positions"],
                                       batch["engram_rows"], strict=True):
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))  # contiguous
                assert np.array_equal(pos[where], np.arange(len(where)))
                n, i = pieces[tuple(tok[where])]  # a whole piece, never cut by the row
                if n not in rows_of:
                    rows_of[n] = hasher.row_ids(np.asarray(encoded[n])[None])[0][0]
                assert np.array_equal(rows[where], rows_of[n][i:i + len(where)])
                seen.add((n, i))
            used += int((seg > 0).sum())
            assert np.all(tok[seg == 0] == 0)
    assert len(seen) > 40 and used > 0.9 * 12 * B * S  # the tight fit leaves little padding
    state = json.loads(json.dumps(it.get_state()))
    want = _batches(it, 2)
    resumed = iter(make(packing="best_fit", packing_bins=4))
    resumed.set_state(state)
    for x, y in zip(want, _batches(resumed, 2), strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
