"""index_scan on the device: the Triton kernel against the XLA path at decode shapes, one JSON line each.

``python -m pallas_kernels.index_scan.bench [--batches 1,32,128] [--entries 2048,65536,524288]``: the release's
index geometry (32 heads × 128 lanes, MXFP4 keys), one query row per sequence; kernel time is profiler device
time (``devtime.busy_us``, median-free: the mean of ``--calls`` back-to-back calls). Bytes are what the scan
must read (68 per key: 64 of nibbles, 4 scale bytes) and write (4 per score), against 4.3 TB/s (a good copy
kernel on the H200, notes/PLATFORM.md) and the device's HBM peak. ``+top-k`` rows add the KV source's
top-512 selection (``indexer.select_topk``: ``lax.top_k``) to each form, what a decode step's full scan costs;
``+radix`` / ``+radix-kernel`` the same 512 entries by the block selection's radix search
(``block_max.select_blocks``, in XLA / with its Mosaic GPU threshold kernels).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import quant
from dsv41_jax.model.indexer import select_topk
from pallas_kernels import benchutil, devtime
from pallas_kernels.block_max.api import select_blocks
from pallas_kernels.index_scan import reference, triton

HEADS, LANES, TOPK = 32, 128, 512  # release index geometry (config.json)
COPY_TB_PER_S = 4.3
HBM_TB_PER_S = {"H100": 3.35, "H200": 4.8}


def inputs(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = jax.random.normal(jax.random.key(seed), (b, t, LANES), jnp.bfloat16)
    codes, exps = jax.jit(quant.pack_mxfp4)(keys)
    iq = quant.qdq_mxfp4(jnp.asarray(rng.standard_normal((b, 1, HEADS, LANES)), jnp.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, 1, HEADS)) * 0.1, jnp.float32)
    return iq, w, codes, exps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--entries", default="2048,65536,524288")
    p.add_argument("--blocks", default="64,128,256")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--xla-max", type=int, default=1 << 24, help="largest batch × entries the XLA path runs at")
    args = p.parse_args()
    kind = jax.devices()[0].device_kind
    hbm = next((v for k, v in HBM_TB_PER_S.items() if k in kind), float("nan"))
    print(json.dumps({"device": kind, "jax": jax.__version__}), flush=True)
    interpret = jax.default_backend() != "gpu"  # elsewhere a smoke run, interpreted
    for b in [int(x) for x in args.batches.split(",")]:
        for t in [int(x) for x in args.entries.split(",")]:
            x = inputs(b, t)
            need = b * t * (68 + 4) + x[0].size * 2 + x[1].size * 4
            nv = jnp.full((b, 1), t, jnp.int32)
            forms = {f"kernel/{blk}": jax.jit(functools.partial(triton.index_scores, block=blk, interpret=interpret))
                     for blk in [int(v) for v in args.blocks.split(",")]}
            if b * t <= args.xla_max:
                forms["xla"] = jax.jit(reference.index_scores)
            kernel = f"kernel/{triton.DEFAULT_BLOCK}"
            selects = {"top-k": lambda sc, nv: select_topk(sc, TOPK, nv),
                       "radix": lambda sc, nv: select_blocks(sc, TOPK, selection="radix", backend="xla"),
                       "radix-kernel": lambda sc, nv: select_blocks(sc, TOPK, selection="radix", backend="pallas")}
            for name in [*forms, "xla+top-k", *(f"{kernel}+{k}" for k in selects)]:
                base, _, sel = name.partition("+")
                if base not in forms:
                    continue
                fn = forms[base] if not sel else jax.jit(
                    lambda *a, f=forms[base], nv=nv, g=selects[sel]: g(f(*a), nv))
                t_us = (devtime.device_time(fn, *x, calls=args.calls) or {}).get("busy_us") \
                    or benchutil.median_us(fn, *x, iters=3, warmup=1)  # off GPU: host time
                print(json.dumps({"form": name, "batch": b, "entries": t, "busy_us": t_us,
                                  "bytes_needed_MB": round(need / 1e6, 2),
                                  "TB_per_s": round(need / t_us / 1e6, 3),
                                  "share_of_4.3TBps": round(need / t_us / 1e6 / COPY_TB_PER_S, 3),
                                  "share_of_hbm_peak": round(need / t_us / 1e6 / hbm, 3)}), flush=True)
            del x


if __name__ == "__main__":
    main()
