"""Tokens/s of greedy decoding with and without DSpark speculative decoding, at batch 1 and 32.

Prints one JSON line per measurement. Per batch size: plain decoding; speculative decoding with every request
verifying K drafts (fixed k); and with verify lengths scheduled from the drafter's confidences against the
target's steps-per-second table, which the script profiles first (``engine.speculative.profile_sps``, as
``dsv41 profile-sps`` does). Each line gives tokens/s of the decode phase (prefill and compilation excluded: a
first run compiles, the second is timed), verify steps, the acceptance rate (drafts accepted / drafted), the
mean accepted length (tokens per verify step), the verify chunks' mean width (rows computed per request and
step), and whether the tokens equal plain greedy decoding's (they must).

Models:

- default: the engine-bench model (``benchmarks/engine_bench.py``: the release's layers and attention at dim
  2048, 16 experts) with random weights and a random drafter of the release's three stages (16 experts too):
  the cost of drafting and verifying, not a speed-up (random drafts are rejected);
- ``--run RUN --drafter DRAFTER.npz``: a trained target and its trained drafter (``dsv41 train`` of a model
  config, then of a ``dspark_train`` config), prompted with documents after the run's training corpus: the
  acceptance rate and speed-up of a real drafter;
- ``--toy``: the tiny config with random weights, a CPU check that the script runs.

Usage: python benchmarks/dspark_bench.py [--toy | --run RUN --drafter NPZ] [--batches 1,32] [--k 5]
[--prompt-len 512] [--new 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dsv41_jax import config as Cfg
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engine.speculative import profile_sps
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model.dspark import DSpark


def random_setup(toy: bool):
    """(model, drafter, Engram hasher) with random weights: the tiny config, or the engine-bench model."""
    from dsv41_jax.model.transformer import Transformer

    if toy:
        cfg = Cfg.from_dict({"preset": "tiny", "dtype": "float32"})
        model = Transformer(cfg, rngs=nnx.Rngs(0))
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        import engine_bench

        cfg = engine_bench.bench_config()
        cfg = cfg.replace(dspark=dataclasses.replace(cfg.dspark, n_routed_experts=16))  # the backbone's 16 experts
        graphdef, state = engine_bench.build(cfg)
        model = nnx.merge(graphdef, state)
    hasher = EngramHasher(cfg.engram, np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size)
    return model, DSpark(cfg, rngs=nnx.Rngs(1)), hasher


def run_setup(run: str, drafter: str):
    """(model, drafter, Engram hasher, held-out documents) of a trained run and its trained drafter."""
    from dsv41_jax.data.corpus import open_documents
    from dsv41_jax.posttrain.recipe import load_run_model, saved_run_config
    from dsv41_jax.train.dspark import load_drafter_npz

    model, hasher = load_run_model(run, dtype="bfloat16")
    d = saved_run_config(run)[0]["data"]
    cap = d["max_documents"]
    docs = open_documents(d["source"], tuple(d.get("paths") or ()), None if cap is None else cap + 256)
    held_out = [docs[i] for i in range(len(docs) - 256 if cap is None else min(cap, len(docs) - 256), len(docs))]
    return model, load_drafter_npz(drafter, model.cfg), hasher, held_out


def prompts_for(batch: int, length: int, vocab: int, documents, tokenizer) -> list[list[int]]:
    if documents is None:
        rng = np.random.default_rng(batch)
        return [list(map(int, rng.integers(4, vocab, length))) for _ in range(batch)]
    ids = [tokenizer.encode(text, add_special_tokens=False).ids[:length] for text in documents]
    ids = [p for p in ids if len(p) == length]
    if len(ids) < batch:
        raise SystemExit(f"only {len(ids)} held-out documents have {length} tokens; lower --prompt-len")
    return ids[:batch]


def timed_decode(gen: Generator, prompts: list[list[int]], speculative: bool) -> tuple[float, list[list[int]]]:
    """Seconds of the decode phase after a prefill, and the tokens; the generator's first call compiles."""
    s = gen.prefill(prompts)
    jax.block_until_ready(s)
    outs = [[] for _ in prompts]
    tick = time.perf_counter()
    if speculative:
        s = gen.start_speculative(s)
        while not bool(s.done.all()):
            s, block = gen.speculative_block(s)
            for i, row in enumerate(block):
                outs[i].extend(int(t) for t in row if t >= 0)
    else:
        while not bool(s.done.all()):
            s, block = gen.decode_block(s)
            for i, row in enumerate(block):
                outs[i].extend(int(t) for t in row if t >= 0)
    return time.perf_counter() - tick, outs


def measure(model, drafter, tables, prompts, sampling: SamplingConfig, max_seq_len: int, plain=None
            ) -> tuple[dict, list[list[int]]]:
    gen = Generator(model, tables, len(prompts), max_seq_len, sampling, drafter=drafter)
    speculative = sampling.speculative > 0
    timed_decode(gen, prompts, speculative)  # compiles
    sec, outs = timed_decode(gen, prompts, speculative)
    n = sum(len(o) for o in outs)
    row = {"tokens": n, "decode_s": sec, "tokens_per_s": n / sec}
    if speculative:
        st = {k: int(v.sum()) for k, v in gen.stats.items()}
        row |= {"steps": st["steps"], "acceptance": st["accepted"] / max(st["drafted"], 1),
                "mean_accepted_length": (st["accepted"] + st["steps"]) / max(st["steps"], 1),
                "mean_verify_width": st["rows"] / max(st["steps"], 1), "equals_plain": outs == plain}
    return row, outs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--toy", action="store_true")
    p.add_argument("--run")
    p.add_argument("--drafter")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--k", type=int, default=0, help="drafts per step (0: the drafter's block size)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--block", type=int, default=8, help="decode / verify steps per compiled call")
    args = p.parse_args(argv)
    documents = tokenizer = None
    if args.run:
        from tokenizers import Tokenizer

        if not args.drafter:
            raise SystemExit("--run needs --drafter DRAFTER.npz (DSpark training's output)")
        model, drafter, hasher, documents = run_setup(args.run, args.drafter)
        tokenizer = Tokenizer.from_file(str(Path(args.run) / "tokenizer.json"))
    else:
        model, drafter, hasher = random_setup(args.toy)
    cfg = model.cfg
    tables = device_engram(hasher)
    k = args.k or cfg.dspark.block_size
    ratio = max(cfg.attention.compress_ratios[i] for i in cfg.attention.kv_source_layers)
    max_seq_len = -(-(args.prompt_len + args.new + k + 1) // ratio) * ratio
    source = f"run {args.run}, drafter {args.drafter}" if args.run else "tiny config" if args.toy else \
        "engine-bench model (release layers, dim 2048, 16 experts)"
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "model": source,
                      "weights": "trained" if args.run else "random", "k": k, "prompt_len": args.prompt_len,
                      "new_tokens": args.new}), flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        prompts = prompts_for(b, args.prompt_len, cfg.vocab_size, documents, tokenizer)
        base = SamplingConfig(temperature=0, max_new_tokens=args.new, stop_tokens=(), block=args.block,
                              prefill_chunk=min(args.prompt_len, 2048))
        plain_row, plain = measure(model, None, tables, prompts, base, max_seq_len)
        print(json.dumps({"bench": "dspark", "batch": b, "mode": "plain"} | plain_row), flush=True)
        table = profile_sps(model, tables, b, k, context=args.prompt_len)["sps"]
        for mode, sampling in (("fixed_k", dataclasses.replace(base, speculative=k)),
                               ("scheduled", dataclasses.replace(base, speculative=k, sps=tuple(table)))):
            row, _ = measure(model, drafter, tables, prompts, sampling, max_seq_len, plain)
            row["speedup"] = row["tokens_per_s"] / plain_row["tokens_per_s"]
            print(json.dumps({"bench": "dspark", "batch": b, "mode": mode, "k": k} | row), flush=True)


if __name__ == "__main__":
    main()
