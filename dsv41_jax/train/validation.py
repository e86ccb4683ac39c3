"""Held-out validation (``validation:`` in the run config).

The last ``validation.documents`` documents of the corpus (in its own, deterministic order, before the
training shuffle) are held out: the run never trains on them. Every ``validation.every`` steps and at the last
step, the mean next-token cross-entropy of the current parameters over the same ``validation.batches`` packed
batches of them is logged as ``val_loss`` (the metrics row of that step: jsonl, TensorBoard, console). The
same batches every time, so the curve moves only with the parameters. The loss is the training forward's
own (:func:`dsv41_jax.train.step.packed_loss`), summed over the batches' targets and divided by their count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ConfigError


@dataclass(frozen=True)
class ValidationConfig:
    documents: int = 0  # held out from the end of the corpus; 0: no validation
    every: int = 100  # steps between validation losses (and the last step)
    batches: int = 4  # packed batches of data.batch_size rows, the same ones every time


class DocumentRange(Sequence):
    """Documents ``[start, stop)`` of ``docs`` as a sequence that reads none of them until asked (a lazy
    parquet or ArrayRecord corpus stays on disk)."""

    def __init__(self, docs: Sequence[str], start: int, stop: int):
        self.docs, self.start, self.stop = docs, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} of {len(self)}")
        return self.docs[self.start + i % len(self)]


def hold_out(docs: Sequence[str], n: int) -> tuple[Sequence[str], Sequence[str]]:
    """(training documents, the last ``n`` documents); a corpus that would keep nothing to train is an error."""
    if n >= len(docs):
        raise ConfigError(f"validation.documents = {n} holds out the whole corpus of {len(docs)} documents; "
                          "hold out fewer")
    return DocumentRange(docs, 0, len(docs) - n), DocumentRange(docs, len(docs) - n, len(docs))


def _sums(graphdef, rest, params, biases, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(Σ next-token NLL, number of targets) of one packed batch [1, b, S]."""
    from dsv41_jax.train.step import packed_loss, targets_and_mask

    model = nnx.merge(graphdef, params, biases, rest)
    tokens, seg = batch["tokens"][0], batch["segment_ids"][0]
    rows = batch["engram_rows"][0] if "engram_rows" in batch else None
    aux = packed_loss(model, tokens, rows, seg, batch["positions"][0], alpha=0.0)
    return aux.sums["ce"], jnp.sum(targets_and_mask(tokens, seg)[1])


class Validator:
    """``val_loss`` of a train state over fixed batches of the held-out documents."""

    def __init__(self, batches: list[dict], model_cfg):
        from dsv41_jax.model.transformer import abstract_model
        from dsv41_jax.train.step import split_model

        graphdef, _, _, rest = split_model(abstract_model(model_cfg))  # shapes only: the state holds the values
        self.batches = batches
        self._sums = jax.jit(functools.partial(_sums, graphdef, rest))

    def loss(self, state) -> float:
        sums = [self._sums(state.params, state.biases, b) for b in self.batches]
        return float(sum(s for s, _ in sums) / sum(n for _, n in sums))


def validator_for(held_out: Sequence[str], tokenizer_path, model_cfg, token_map, cfg, mesh) -> Validator:
    """The :class:`Validator` of run config ``cfg`` over the ``held_out`` documents, packed as the training
    data is (this host's share of each global batch, placed as the train step's batches are)."""
    from dsv41_jax.data.pipeline import packed_dataset
    from dsv41_jax.train.step import batch_sharding

    d = cfg.data
    ds = packed_dataset(held_out, tokenizer_path, model_cfg, token_map, seq_len=d.seq_len, batch_size=d.batch_size,
                        seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count(),
                        read_threads=0, packing=d.packing, packing_bins=d.packing_bins)
    it, sharding = iter(ds), batch_sharding(mesh)
    batches = [{k: jax.make_array_from_process_local_data(sharding, v[None]) for k, v in next(it).items()}
               for _ in range(cfg.validation.batches)]  # [1, B, ...]: one micro-batch, as the step's
    return Validator(batches, model_cfg)
