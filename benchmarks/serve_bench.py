"""Load generator for ``dsv41 serve`` (the issue's measurements; run on the device next to the server).

``load``: throughput (generated tokens/s) and time to first token / inter-token latency (p50, p90) at several
numbers of concurrent streams. ``resume``: time to first token of a long conversation continued from each
prefix-cache tier, against a cold prefill of the same tokens; ``--phase disk`` continues the saved conversation
after a server restart. One JSON line per measurement.

    dsv41 serve --ckpt out/v41 --max-batch 128 --max-seq-len 131072 --prefix-cache-dir /tmp/pc &
    python benchmarks/serve_bench.py load --concurrency 1,8,32,128
    python benchmarks/serve_bench.py resume --context 65536 --state /tmp/conv.json
    # restart the server, then
    python benchmarks/serve_bench.py resume --phase disk --state /tmp/conv.json
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def stream(client, model: str, prompt: list[int], max_tokens: int, salt: str) -> dict:
    """One streamed greedy completion: its tokens, the time of the first and the inter-token latencies (tokens
    arrive a decode block at a time: each block's gap is shared by its tokens)."""
    t0 = last = time.perf_counter()
    ids, ttft, itl = [], None, []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"return_token_ids": True, "cache_salt": salt}):
        got = chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
        if not got:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            itl += [(now - last) / len(got)] * len(got)
        last, ids = now, ids + got
    return {"ids": ids, "ttft": ttft, "itl": itl}


def hits(url: str) -> dict[str, float]:
    out = {}
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line.startswith(("dsv41_prefix_cache_hits_total{", "dsv41_prefix_cache_misses_total ")):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def load(client, args, rng) -> None:
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [[0, *rng.integers(4, args.vocab, size=args.prompt_len - 1).tolist()] for _ in range(c)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            runs = list(pool.map(lambda p: stream(client, args.model, p, args.new_tokens, uuid.uuid4().hex), prompts))
        wall = time.perf_counter() - t0
        ttft = [r["ttft"] for r in runs if r["ttft"] is not None]
        itl = np.asarray(sum((r["itl"] for r in runs), []))
        print(json.dumps({"bench": "load", "concurrency": c, "tokens_per_s": sum(len(r["ids"]) for r in runs) / wall,
                          "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
                          "itl_p50_s": float(np.percentile(itl, 50)) if itl.size else None,
                          "itl_p90_s": float(np.percentile(itl, 90)) if itl.size else None}), flush=True)


def timed_turn(client, args, prompt: list[int], salt: str, label: str) -> list[int]:
    before = hits(args.url)
    run = stream(client, args.model, prompt, args.new_tokens, salt)
    after = hits(args.url)
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    print(json.dumps({"bench": "resume", "from": label, "context": len(prompt), "ttft_s": run["ttft"],
                      "cache": changed}), flush=True)
    return run["ids"]


def resume(client, args, rng) -> None:
    turn = rng.integers(4, args.vocab, size=64).tolist()
    if args.phase == "disk":
        conv = json.loads(open(args.state).read())
        timed_turn(client, args, conv["tokens"] + turn, conv["salt"], "disk")
        return
    salt = uuid.uuid4().hex
    tokens = [0, *rng.integers(4, args.vocab, size=args.context - 1).tolist()]
    tokens += timed_turn(client, args, tokens, salt, "cold (first turn)")
    tokens += turn
    timed_turn(client, args, tokens, uuid.uuid4().hex, "cold")  # the same tokens, no shared cache
    tokens += timed_turn(client, args, tokens, salt, "device")
    rows = int(float(next(line.split()[1] for line in urllib.request.urlopen(args.url + "/metrics").read().decode()
                          .splitlines() if line.startswith("dsv41_batch_rows "))))
    with ThreadPoolExecutor(rows) as pool:  # every row taken: the conversation leaves the device
        list(pool.map(lambda i: stream(client, args.model, [0, 5 + i], 4, uuid.uuid4().hex), range(rows)))
    tokens += turn
    tokens += timed_turn(client, args, tokens, salt, "host")
    with open(args.state, "w") as f:
        json.dump({"salt": salt, "tokens": tokens}, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", choices=["load", "resume"])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model id (default: the server's only model)")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=65536, help="resume: tokens of the conversation")
    p.add_argument("--phase", choices=["tiers", "disk"], default="tiers")
    p.add_argument("--state", default="serve_bench_conversation.json", help="resume: the conversation, for disk")
    p.add_argument("--vocab", type=int, default=128000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    args.model = args.model or client.models.list().data[0].id
    rng = np.random.default_rng(args.seed)
    (load if args.bench == "load" else resume)(client, args, rng)


if __name__ == "__main__":
    main()
