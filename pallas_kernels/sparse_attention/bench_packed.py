"""Decode attention over the packed caches on the device: ``packed_decode.sparse_decode`` (Triton, split over the
keys) against the XLA path the engine runs (unpack the ring and the picked rows, then
:func:`dsv41_jax.model.sparse.sparse_attention`), one JSON line per measurement.

``python -m pallas_kernels.sparse_attention.bench_packed [--batches 1,32,128] [--configs 16x32x4,...]``: the release
geometry (64 heads × 512, ring of 128, top-k 512 of a 32K-token context's entries), bf16; device time from the
profiler (``devtime.busy_us``). ``--configs`` lists kernel variants as HEADSxBLOCKxWARPS. Each kernel line also
gives its worst row's relative L2 distance from the XLA path. Bytes: what the call must read from the caches
(the ring's 128 × 528 B and 512 picked rows of 288 B per sequence) and the query.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import quant
from pallas_kernels import benchutil, devtime
from pallas_kernels.sparse_attention import api
from pallas_kernels.sparse_attention.packed_decode import sparse_decode

N, H, W, K, T = 64, 512, 128, 512, 8192


def inputs(b: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    q = jax.random.normal(key, (b, 1, N, H), jnp.bfloat16)
    own = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, H), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(N), jnp.float32)
    rv, re = jax.jit(quant.pack_fp8_ue8m0)(jax.random.normal(jax.random.fold_in(key, 2), (b, W, H), jnp.float32))
    kc, ks = jax.jit(quant.pack_nvfp4)(jax.random.normal(jax.random.fold_in(key, 3), (b, T, H), jnp.float32))
    topk = jnp.asarray(np.sort(rng.permuted(np.tile(np.arange(T), (b, 1)), axis=1)[:, :K], axis=1)[:, None], jnp.int32)
    start = jnp.full((b,), 4 * T, jnp.int32)
    last = start[:, None] - 1
    ring_pos = last - jnp.mod(last - jnp.arange(W)[None], W)
    return q, own, sink, rv, re, ring_pos, kc, ks, topk, start, jnp.zeros((b,), jnp.int32)


def xla_path(q, own, sink, rv, re, ring_pos, kc, ks, topk, start, floor, backend="xla"):
    ring = quant.unpack_fp8_ue8m0(rv, re, q.dtype)
    picked = quant.unpack_nvfp4(jax.vmap(lambda c, i: c[i])(kc, topk), jax.vmap(lambda c, i: c[i])(ks, topk), q.dtype)
    return api.sparse_attention(q, own, sink, W, topk=topk, picked=picked, replay_start=floor, start=start,
                                prefix_kv=ring, prefix_pos=ring_pos, backend=backend)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--configs", default="16x32x4,16x32x8,32x32x8,32x16x4")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    for b in [int(x) for x in args.batches.split(",")]:
        x = inputs(b)
        need = b * (W * (H + H // 32) + K * (H // 2 + H // 16 + 4) + N * H * 2 * 2 + H * 2)
        forms = {"xla": jax.jit(xla_path)}
        if gpu:  # the unpacked keys through the Mosaic kernel (where api.kernel_applies: batch >= 64)
            forms["unpack+mosaic"] = jax.jit(functools.partial(xla_path, backend="pallas"))
        for c in args.configs.split(","):
            hb, blk, nw = (int(v) for v in c.split("x"))
            forms[f"kernel/{c}"] = jax.jit(lambda *a, hb=hb, blk=blk, nw=nw: sparse_decode(
                *a[:3], W, *a[3:], heads=hb, block=blk, num_warps=nw, interpret=not gpu))
        want = np.asarray(forms["xla"](*x), np.float32)
        for name, fn in forms.items():
            try:
                got = np.asarray(fn(*x), np.float32)
            except Exception as e:  # a variant the compiler refuses: say so, go on
                error = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps({"form": name, "batch": b, "error": error}), flush=True)
                continue
            rel = float((np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)).max())
            t_us = (devtime.device_time(fn, *x, calls=args.calls) or {}).get("busy_us") \
                or benchutil.median_us(fn, *x, iters=3, warmup=1)
            print(json.dumps({"form": name, "batch": b, "busy_us": t_us, "bytes_needed_MB": round(need / 1e6, 3),
                              "TB_per_s": round(need / t_us / 1e6, 3), "max_row_rel_vs_xla": rel}), flush=True)


if __name__ == "__main__":
    main()
