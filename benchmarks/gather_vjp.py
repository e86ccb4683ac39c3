"""The backward of sparse attention's top-k gather, alone, at train-step shapes: one JSON line per variant.

``kv[b, idx[b, s, k]]`` transposes into a scatter-add of S·K rows onto T entries, and in a causal train
step the early entries are picked by nearly every query (heavy collisions). Variants of d kv, all for the
same cotangent:

- ``autodiff_bf16``: the plain gather differentiated by JAX (a scatter-add in the cache dtype);
- ``fp32`` (the model's ``sparse.gather_entries``): a scatter-add into an fp32 buffer, rounded once;
- ``sorted_fp32``: the (row, entry) pairs sorted by entry first, then the fp32 scatter with sorted indices.

Run on the device: ``PYTHONPATH=. python benchmarks/gather_vjp.py [--seq 8192 --topk 512 --lanes 256]``.
``max_abs_vs_fp32`` compares each variant with the fp32 result (the exact sum rounded once to bf16).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from dsv41_jax.model import sparse
from pallas_kernels import benchutil


def _plain(kv, idx):
    return jax.vmap(lambda kv_, i: kv_[i])(kv, idx)


def _sorted_fp32(kv, idx, g):
    b, t, h = kv.shape

    def one(i, g_):
        flat = i.reshape(-1)
        order = jnp.argsort(flat)
        rows = g_.reshape(-1, h)[order].astype(jnp.float32)
        return jnp.zeros((t, h), jnp.float32).at[flat[order]].add(rows, indices_are_sorted=True)

    return jax.vmap(one)(idx, g).astype(kv.dtype)


def variants():
    def vjp_of(gather):
        return lambda kv, idx, g: jax.vjp(lambda x: gather(x, idx), kv)[1](g)[0]

    return {  # fp32 first: the others are compared with it
        "fp32": vjp_of(sparse.gather_entries),
        "autodiff_bf16": vjp_of(_plain),
        "sorted_fp32": _sorted_fp32,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--lanes", type=int, default=256)
    p.add_argument("--ratios", default="1,2", help="compression ratios: T = seq / ratio entries")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    s, k, h = args.seq, args.topk, args.lanes
    for ratio in map(int, args.ratios.split(",")):
        t = s // ratio
        # causal picks: query s sees entries [0, max(1, (s + 1) // ratio)), k draws each
        visible = jnp.maximum((jnp.arange(s) + 1) // ratio, 1)[None, :, None]
        idx = (jax.random.uniform(jax.random.key(1), (1, s, k)) * visible).astype(jnp.int32)
        kv = jax.random.normal(jax.random.key(2), (1, t, h), jnp.bfloat16)
        g = jax.random.normal(jax.random.key(3), (1, s, k, h), jnp.bfloat16)
        ref = None
        fwd_us = benchutil.median_us(jax.jit(_plain), kv, idx, iters=args.iters)
        for name, fn in variants().items():
            f = jax.jit(fn)
            out = f(kv, idx, g)
            if name == "fp32":
                ref = out
            us = benchutil.median_us(f, kv, idx, g, iters=args.iters)
            err = None if ref is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            print(json.dumps({"bench": "gather_vjp", "variant": name, "seq": s, "topk": k, "lanes": h,
                              "entries": t, "median_us": round(us, 1), "forward_gather_us": round(fwd_us, 1),
                              "cotangent_gb_per_s": round(g.size * 2 / us / 1e3, 1), "max_abs_vs_fp32": err,
                              "device": jax.devices()[0].device_kind}), flush=True)


if __name__ == "__main__":
    main()
