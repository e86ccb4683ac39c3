"""The multi-device half of ``test_sampling_mesh.py`` (run with 8 fake CPU devices).

Greedy generation from the golden checkpoint with the weights sharded over a mesh (experts over ``expert``)
and MoE layers expert-parallel; prints one JSON line per mesh with the generated tokens and the reference's.
Then greedy speculative decoding on a data=2 × expert=4 mesh against plain greedy decoding on one device: a
2-layer tiny model and a one-stage drafter (random weights) keep the programs small; the drafter's Markov head
holds the bigrams of the one-device output with one left out (``testing.bigram_drafter``), so the mesh run
accepts whole blocks and also rejects a draft.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.load import model_from_hf
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.testing import GOLDEN, bigram_drafter
from dsv41_jax.train.step import build_mesh


def main():
    model, hasher = model_from_hf(GOLDEN / "tiny_hf")
    ids = np.load(GOLDEN / "inputs.npz")["batch2_ids"]
    ref = np.load(GOLDEN / "ref_fp32.npz")
    want = np.concatenate([ref["batch2_decode_input_ids"], ref["batch2_decode_next_ids"][:, -1:]], axis=1)[:, :8]
    sampling = SamplingConfig(temperature=0, max_new_tokens=8, stop_tokens=(), block=4, prefill_chunk=64)
    for shape in ((1, 1, 2, 1),):
        mesh = build_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])
        gen = Generator(model, device_engram(hasher), 2, 256, sampling, mesh=mesh)
        state = gen.prefill([list(r) for r in ids])
        spec = state.cache.rings[0][0].sharding.spec
        got = gen.generate([list(r) for r in ids])
        expert_w = gen.state["layers"][2]["ffn"]["experts"]["w1"]["weight"][...]
        print(json.dumps({"mesh": shape, "tokens": got, "want": want.tolist(), "cache_spec": str(spec),
                          "expert_shards": len({str(s.index) for s in expert_w.addressable_shards})}))


MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2,
         "attention": {"compress_ratios": [2, 1, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                       "candidate_source_layer": 1},
         "engram": {"layer_ids": [0], "num_embeddings": [434]}, "dspark": {"n_layers": 1, "target_layer_ids": [0, 1]}}
K, NEW, BATCH = 4, 10, 8


def speculative() -> None:
    """Greedy speculative decoding on a data=2 × expert=4 mesh against plain greedy decoding on one device."""
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
    stats = {k: v.tolist() for k, v in gen.stats.items()}
    print(json.dumps({"speculative": True, "tokens": got, "want": plain, "stats": stats,
                      "draft_rings_split": spec.draft.rings[0].values.sharding.spec[0] == ("data", "expert"),
                      "drafter_expert_shards": len({str(s.index) for s in experts.addressable_shards})}))


if __name__ == "__main__":
    main()
    speculative()
