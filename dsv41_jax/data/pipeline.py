"""The grain pipeline: documents → tokens + Engram row ids → packed fixed-length rows → per-host batches.

Per document: ``[BOS] + ids + [EOS]`` and its Engram row ids (spec model §6.5), hashed with a fresh history
so n-grams never reach across documents. ``segment_ids`` number the documents of a row from 1 (0 = padding)
and ``positions`` restart at 0 in each piece of a document. Two packings (``data.packing``):

- ``concat`` (the default): concat-then-split (grain's ``ConcatThenSplitIterDataset``): no padding, but a
  document that meets a row's end continues in the next row;
- ``best_fit`` (the release's, spec model §9.4): a document longer than a row is first split into row-long
  pieces, deterministically, then grain's ``BestFitPackIterDataset`` puts each piece whole into the open row
  it fills tightest (of ``packing_bins`` rows kept open); the rest of a row is padding.

Segment ids shape the loss (no target across a document boundary) and, with the positions, the model's
document masking: no information flows between the documents of a row (``dsv41_jax.model.documents``).

Determinism: the document order is a seeded shuffle, each host takes every ``process_count``-th document,
and the iterator state (``get_state`` / ``set_state``) resumes mid-epoch exactly. The documents are any
random-access sequence (a list, or a lazy file source from ``corpus.open_documents``): only the documents a
host reads are ever loaded.

Background work never changes the stream: ``read_threads`` threads encode documents ahead in order (grain's
``ReadOptions``), and ``prefetch`` finished batches are produced ahead by one background thread (grain's
``ThreadPrefetchIterDataset``, whose state is the consumer's position, so a checkpoint taken with batches
waiting in the buffer resumes at the first batch not yet handed out). Multiprocess workers are not offered:
grain shards the documents over the workers, which changes the packing and so the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np
from grain.experimental import (
    BestFitPackIterDataset,
    ConcatThenSplitIterDataset,
    FlatMapIterDataset,
    FlatMapTransform,
    ThreadPrefetchIterDataset,
)

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.engram_hash import EngramHasher


class _Encode:
    """Document text → {"tokens": int32 [n], "rows": int32 [n, L, C]} (a class so grain can name it)."""

    def __init__(self, tokenizer_path: Path, cfg: ModelConfig, token_map: np.ndarray):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))
        self.cfg = cfg
        self.hasher = EngramHasher(cfg.engram, token_map) if cfg.engram.layer_ids else None

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        tokens = np.asarray([self.cfg.bos_token_id, *ids, self.cfg.eos_token_id], np.int64)
        out = {"tokens": tokens.astype(np.int32)}
        if self.hasher is not None:
            rows, _ = self.hasher.row_ids(tokens[None])  # [1, n, L, C] int64, fresh history (§6.5)
            out["rows"] = rows[0].astype(np.int32)  # every table < 2**31 rows
        return out


class _Split(FlatMapTransform):
    """An encoded document → pieces of at most ``seq_len`` positions, in order (the same cut for its tokens and
    its Engram rows, whose n-gram history stays the whole document's): best-fit packing takes no longer one."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.max_fan_out = 2**31  # a document may be any length; the iterator never enumerates fan-outs

    def flat_map(self, doc: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        n = len(doc["tokens"])
        return [{k: v[i:i + self.seq_len] for k, v in doc.items()} for i in range(0, n, self.seq_len)]


PACKINGS = ("concat", "best_fit")


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"].astype(np.int32),
           "positions": row["tokens_positions"].astype(np.int32)}
    if "rows" in row:
        out["engram_rows"] = row["rows"]
    return out


def packed_dataset(documents: Sequence[str], tokenizer_path: Path, cfg: ModelConfig, token_map: np.ndarray, *,
                   seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1, read_threads: int = 16, prefetch: int = 0, packing: str = "concat",
                   packing_bins: int = 64) -> grain.IterDataset:
    """Endless per-host batches: tokens/segment_ids/positions int32 [b, S], engram_rows int32 [b, S, L, C].

    ``batch_size`` is global; each of ``process_count`` hosts yields ``batch_size / process_count`` rows.
    ``packing`` is ``concat`` or ``best_fit`` (with ``packing_bins`` rows open at once; see the module).
    """
    if packing not in PACKINGS:
        raise ConfigError(f"data.packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
    if batch_size % process_count:
        raise ConfigError(f"data.batch_size {batch_size} is not divisible by the {process_count} hosts")
    if len(documents) < process_count:
        raise ConfigError(f"{len(documents)} documents cannot feed {process_count} hosts")
    ds = grain.MapDataset.source(documents).shuffle(seed=seed)[process_index::process_count]
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=500 if read_threads else 0)
    ds = ds.repeat(None).map(_Encode(tokenizer_path, cfg, token_map)).to_iter_dataset(read)
    lengths = {"tokens": seq_len} | ({"rows": seq_len} if cfg.engram.layer_ids else {})
    if packing == "best_fit":
        ds = FlatMapIterDataset(ds, _Split(seq_len))
        ds = BestFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=packing_bins, seed=seed)
    else:
        ds = ConcatThenSplitIterDataset(ds, length_struct=lengths)
    ds = ds.map(_rename).batch(batch_size // process_count, drop_remainder=True)
    if prefetch:
        ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds


def loss_mask(segment_ids: np.ndarray) -> np.ndarray:
    """bool [B, S]: position t has a target (t+1 is in the same document); the last column never does."""
    seg = np.asarray(segment_ids)
    nxt = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
    return (seg > 0) & (seg == nxt)


@dataclasses.dataclass
class DataState:
    """The iterator and the documents it reads; ``state()``/``restore()`` go into every checkpoint."""

    iterator: grain.DatasetIterator

    def next(self, n: int) -> dict[str, np.ndarray]:
        """``n`` batches stacked on a new leading axis (micro-batches of one optimizer step)."""
        batches = [next(self.iterator) for _ in range(n)]
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}

    def state(self) -> dict:
        return self.iterator.get_state()

    def restore(self, state: dict) -> None:
        self.iterator.set_state(state)
