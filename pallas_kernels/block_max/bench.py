"""block_max timings: XLA reference vs the Pallas pass, alone and with the XLA top_k, one JSON line each.

Run on the device: ``python -m pallas_kernels.block_max.bench``. Floor = score bytes read (+ maxima
written) / copy bandwidth. The issue's XLA baseline (block max + top_k(2048) on [8, 2^20]) was 0.34 ms.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels import benchutil
from pallas_kernels.block_max import api

BLOCK, TOPK = 8, 2048  # candidate_block_size, candidate_topk_blocks of the release (spec attention §6)
# (B, S, T): prefill-like 8 queries over 1M positions; decode batches of one query each
SHAPES = [(8, 1, 1 << 20), (128, 1, 1 << 17), (32, 1, 1 << 20)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    for b, s, t in SHAPES:
        scores = jax.random.normal(jax.random.key(0), (b, s, t), jnp.float32)
        n = jnp.full((b, s), t, jnp.int32) - jnp.arange(b * s, dtype=jnp.int32).reshape(b, s)
        scores = jnp.where(jnp.arange(t) < n[..., None], scores, -jnp.inf)
        moved = scores.size * 4 + scores.size // BLOCK * 4
        for backend in api.BACKENDS:
            f = jax.jit(lambda x, n, backend=backend: api.block_max(x, n, BLOCK, backend=backend))
            us = benchutil.median_us(f, scores, n, iters=args.iters)
            benchutil.emit("block_max", backend, (b, s, t), us, moved, scores.size, stage="block_max")
            for selection in api.SELECTIONS:
                g = jax.jit(lambda x, n, backend=backend, sel=selection: api.candidate_block_ids(
                    x, n, BLOCK, TOPK, backend=backend, selection=sel))
                us = benchutil.median_us(g, scores, n, iters=args.iters)
                benchutil.emit("block_max", backend, (b, s, t), us, moved, scores.size, stage=f"with_{selection}")


if __name__ == "__main__":
    main()
