"""The multi-device half of ``test_sampling_mesh.py`` (run with 8 fake CPU devices); one JSON line per check.

``dsv41 serve --mesh expert=8`` of the golden checkpoint, converted and restored straight into its shards:
greedy completions through the openai client, their sequences split over the expert axis and MoE layers
expert-parallel, against the reference's tokens (which one device reproduces, ``tests/serve``); a conversation
resumed from the host tier (its global KV and rings written back into the sharded cache) against a cold run.
Then greedy speculative decoding on a data=2 × expert=4 mesh against plain greedy decoding on one device: a
2-layer tiny model and a one-stage drafter (random weights) keep the programs small; the drafter's Markov head
holds the bigrams of the one-device output with one left out (``testing.bigram_drafter``), so the mesh run
accepts whole blocks and also rejects a draft.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import uvicorn
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.serve import ServeOptions, build
from dsv41_jax.testing import GOLDEN, bigram_drafter
from dsv41_jax.train.step import build_mesh


def serve_in_thread(app) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1"


def served(root: Path) -> dict:
    ids = np.load(GOLDEN / "inputs.npz")["batch2_ids"].tolist()
    extra = np.load(GOLDEN / "inputs.npz")["batch1_ids"][0, :10].tolist()
    want = np.load(GOLDEN / "ref_fp32.npz")["batch2_decode_input_ids"][:, :8].tolist()
    ckpt = convert(GOLDEN / "tiny_hf", root / "ckpt", weights="fp32", progress=False).out
    opts = ServeOptions(max_batch=8, max_seq_len=256, prefill_mode="exact", prefill_chunk=64, block=4,
                        dtype="float32", mesh="expert=8", name="m")
    app, scheduler = build(opts, ckpt=ckpt, log=lambda line: None)
    client = openai.OpenAI(base_url=serve_in_thread(app), api_key="none", max_retries=0, timeout=600)

    def greedy(prompt, salt, n=8):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"return_token_ids": True, "cache_salt": salt})
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(2) as pool:  # the two golden prompts, batched together
        tokens = list(pool.map(lambda i: greedy(ids[i], "conv"), range(2)))
    spec = str(scheduler.state.cache.rings[0][0].sharding.spec)
    continued = ids[0] + tokens[0] + extra
    cold = greedy(continued, "cold")
    with ThreadPoolExecutor(8) as pool:  # every row taken: the conversation leaves the device
        list(pool.map(lambda i: greedy([0, 5 + i, 7], f"busy{i}", 12), range(8)))
    hit = greedy(continued, "conv")
    host = sum(float(line.split()[-1]) for line in scheduler.metrics.text().decode().splitlines()
               if line.startswith('dsv41_prefix_cache_hits_total{swa="live",tier="host"}'))
    w1 = scheduler.gen.state["layers"][2]["ffn"]["experts"]["w1"]["weight"][...]
    scheduler.stop()
    return {"served": True, "mesh": dict(scheduler.gen.mesh.shape), "tokens": tokens, "want": want, "cache_spec": spec,
            "expert_shards": len({str(s.index) for s in w1.addressable_shards}), "hit": hit, "cold": cold,
            "host_hits": host}



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
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(served(Path(d))), flush=True)
    speculative()
