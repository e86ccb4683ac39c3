"""``data.packing: best_fit`` reaches the run's data: its rows hold whole documents and padding, where the
default concat-then-split rows are full (the pipeline's own tests check the packings themselves)."""

from __future__ import annotations

import json

import numpy as np

from dsv41_jax.data.corpus import read_documents
from dsv41_jax.train.config import from_dict
from dsv41_jax.train.loop import setup

MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2,
         "attention": {"compress_ratios": [2, 1, 0, 0, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                       "candidate_source_layer": 1},
         "engram": {"layer_ids": [0, 1]}, "dspark": {"target_layer_ids": [0, 1, 1]}}


def test_best_fit_reaches_the_runs_batches(tmp_path):
    corpus = tmp_path / "docs.jsonl"  # pieces of the embedded corpus, 40 to 400 characters: several to a row
    text = "".join(read_documents("embedded", limit=20))
    cuts = np.cumsum(np.random.default_rng(0).integers(40, 400, 400))
    corpus.write_text("".join(json.dumps({"text": text[a:b]}) + "\n" for a, b in zip(cuts[:-1], cuts[1:], strict=True)))
    fill = {}
    for packing in ("concat", "best_fit"):
        cfg = from_dict({"model": MODEL, "steps": 1, "checkpoint": {"dir": str(tmp_path / packing)},
                         "logging": {"tensorboard": None},
                         "data": {"source": "jsonl", "paths": [str(corpus)], "tokenizer_train_documents": 399,
                                  "seq_len": 64, "batch_size": 2, "read_threads": 0, "packing": packing,
                                  "packing_bins": 2}})
        run = setup(cfg, log=lambda _: None)
        run.checkpointer.close()
        seg = np.concatenate([np.asarray(run.next_batch()["segment_ids"]) for _ in range(4)])  # [4A, B, S]
        fill[packing] = float((seg > 0).mean())
    assert fill["concat"] == 1.0 and 0.5 < fill["best_fit"] < 1.0, fill  # best-fit rows end in padding
