"""The routed experts of a decode step on the device: each routed path's forms over a stack of layers.

    python benchmarks/moe_decode_bench.py [--layers 8] [--tokens 1,8,32,128] [--reps 20] [--shape engine|release]

``engine``: the engine-bench model's experts (dim 2048, 16 of 1024, K 6, bf16 weights); ``release``: the
release's (``Cfg.v41_flash()``: dim 5120, 384 of 2304, K 6; MXFP4 codes with E8M0 scales). The layers
are ``--layers`` copies written out in one program, each its own weights (so that the picked experts are read
from memory, not from L2), one token per sequence, each token picking K distinct experts. Per form: median µs
per layer of a jitted call (the call's launch spread over the layers), the bytes the form needs (the picked
experts' stored bytes for ``gather``; every expert's for ``dense`` and ``grouped``) and their share of the
device's copy rate (``benchutil.COPY_BYTES_PER_S``, the H200's), and the largest difference of the first layer's
output from ``grouped``'s, relative to its largest entry (later layers feed their rounded outputs on, so they
drift apart by more than one layer's rounding).

Forms: ``grouped`` (token copies sorted by expert, ``moe.grouped_matmul`` over all experts; on XLA:GPU
``lax.ragged_dot`` with a transposed copy of each weight), ``gather`` (``take`` of the picked experts then
``einsum``), ``gather-fused`` (the picked experts read inside the reductions), ``dense`` (every expert on every
token, weighted 0 where unpicked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import config as Cfg
from dsv41_jax import quant
from dsv41_jax.model import moe
from pallas_kernels.benchutil import COPY_BYTES_PER_S, median_us


def stacked_experts(key, layers: int, n: int, dim: int, inter: int, native: bool):
    """``(w1, w2, w3)`` per layer as stored arrays with a leading layer axis: bf16, or MXFP4 codes + scales."""
    out = []
    for i, (rows, cols) in enumerate(((inter, dim), (dim, inter), (inter, dim))):
        k = jax.random.fold_in(key, i)
        if native:
            codes = jax.random.randint(k, (layers, n, rows, cols // 2), 0, 256, jnp.int32).astype(jnp.uint8)
            scales = jnp.full((layers, n, rows, cols // quant.MXFP4_BLOCK), 120, jnp.uint8)
            out.append((codes, scales))
        else:
            w = jax.random.normal(k, (layers, n, rows, cols), jnp.float32) * cols ** -0.5
            out.append((w.astype(jnp.bfloat16),))
    return tuple(out)


def form(name: str, limit: float):
    def layer(x, e, w, stored):
        if name in ("gather", "gather-fused"):
            return moe._gathered_experts(x, e, w, stored, limit, fused=name == "gather-fused")
        w1, w2, w3 = (moe._dequant(a, x.dtype) for a in stored)
        if name == "dense":
            return moe._dense_experts(x, e, w, w1, w2, w3, limit)
        return moe._local_experts(x, e, w, w1, w2, w3, limit, first=0, implementation="xla")

    def run(x, e, w, stacked):
        # the layers written out, as the decode step's are: a scan's trips are launched one by one on GPU
        # (in the engine's loop the fused gathers read at 2.3-2.5 TB/s, in the scan at 0.84)
        first = None
        for i in range(jax.tree.leaves(stacked)[0].shape[0]):
            y = layer(x, e, w, jax.tree.map(lambda a, i=i: a[i], stacked))
            first = y if first is None else first
            x = (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(x.dtype)
        return x, first[None]

    return jax.jit(run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", default="1,8,32,128")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shape", default="engine", choices=("engine", "release"))
    p.add_argument("--forms", default="grouped,gather,gather-fused,dense")
    args = p.parse_args()
    m = Cfg.v41_flash().moe
    if args.shape == "engine":
        dim, m, native = 2048, dataclasses.replace(m, n_routed_experts=16, moe_inter_dim=1024), False
    else:
        dim, native = Cfg.v41_flash().dim, True
    n, k, inter = m.n_routed_experts, m.n_activated_experts, m.moe_inter_dim
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": args.shape, "dim": dim,
                      "experts": n, "k": k, "inter": inter, "native": native, "layers": args.layers}), flush=True)
    stacked = stacked_experts(jax.random.key(0), args.layers, n, dim, inter, native)
    per_expert = sum(a.nbytes for s in stacked for a in s) / args.layers / n
    rng = np.random.default_rng(0)
    for t in (int(v) for v in args.tokens.split(",")):
        x = jnp.asarray(rng.normal(0, 1, (t, dim)), jnp.bfloat16)
        e = jnp.asarray(np.stack([rng.choice(n, k, replace=False) for _ in range(t)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 0.4, (t, k)), jnp.float32)
        distinct = len(np.unique(np.asarray(e)))
        base = None
        for name in args.forms.split(","):
            fn = form(name, m.swiglu_limit)
            _, out = fn(x, e, w, stacked)
            out = np.asarray(out[0], np.float32)  # the first layer's output
            base = out if base is None else base
            us = median_us(fn, x, e, w, stacked, iters=args.reps) / args.layers
            needed = (t * k if name.startswith("gather") else n) * per_expert
            print(json.dumps({"tokens": t, "form": name, "us_per_layer": round(us, 1),
                              "distinct_experts": distinct, "bytes_read_MB": round(needed / 1e6, 2),
                              "share_of_copy_rate": round(needed / COPY_BYTES_PER_S / (us * 1e-6), 3),
                              "picked_floor_us": round(distinct * per_expert / COPY_BYTES_PER_S * 1e6, 1),
                              "max_rel_diff": float(np.abs(out - base).max() / np.abs(base).max())}), flush=True)


if __name__ == "__main__":
    main()
