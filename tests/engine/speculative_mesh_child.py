"""The multi-device half of ``test_speculative_mesh.py`` (run with 8 fake CPU devices): greedy speculative
decoding on a data=2 × expert=4 mesh against plain greedy decoding on one device; one JSON line.

A 2-layer tiny model and a one-stage drafter (random weights) keep the programs small; the drafter's Markov
head holds the bigrams of the one-device output with one left out (``testing.bigram_drafter``), so the mesh
run accepts whole blocks and also rejects a draft.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.testing import bigram_drafter
from dsv41_jax.train.step import build_mesh

MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2,
         "attention": {"compress_ratios": [2, 1, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                       "candidate_source_layer": 1},
         "engram": {"layer_ids": [0], "num_embeddings": [434]}, "dspark": {"n_layers": 1, "target_layer_ids": [0, 1]}}
K, NEW, BATCH = 4, 10, 8


def main() -> None:
    cfg = C.from_dict(MODEL)
    model, drafter = Transformer(cfg, rngs=nnx.Rngs(0)), DSpark(cfg, rngs=nnx.Rngs(1))
    tables = device_engram(EngramHasher(cfg.engram, np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, 500, n))) for n in rng.integers(3, 15, BATCH)]
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW, stop_tokens=(), block=4, prefill_chunk=16)
    plain = Generator(model, tables, BATCH, 32, sampling).generate(prompts)
    nnx.update(drafter, bigram_drafter(drafter, plain, skip={(plain[0][2], plain[0][3])}))
    mesh = build_mesh((2, 1, 4, 1))
    gen = Generator(model, tables, BATCH, 32, dataclasses.replace(sampling, speculative=K), mesh=mesh,
                    drafter=drafter)
    got = gen.generate(prompts)
    spec = gen.start_speculative(gen.prefill(prompts))
    experts = gen.dstate["mtp"][0]["ffn"]["experts"]["w1"]["weight"][...]
    print(json.dumps({"tokens": got, "want": plain, "stats": {k: v.tolist() for k, v in gen.stats.items()},
                      "draft_rings_split": spec.draft.rings[0].values.sharding.spec[0] == ("data", "expert"),
                      "drafter_expert_shards": len({str(s.index) for s in experts.addressable_shards})}))


if __name__ == "__main__":
    main()
