"""block_max timings at the bench.py shapes: XLA reference, a device copy of the scores and Mosaic GPU
variants (mosaic.py), alone and followed by the XLA top_k of ``api.candidate_block_ids``; one JSON line
each.

Run on the device: ``python -m pallas_kernels.block_max.bench_mosaic [--variant k=v,k=v ...]``, as
fp4_pack.bench_mosaic (``exact`` compares with the XLA result; failures print an ``error`` line).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bench_variants import header, measure, parse_variant
from pallas_kernels.block_max import api, mosaic, reference
from pallas_kernels.block_max.bench import BLOCK, SHAPES, TOPK

DEFAULT_VARIANTS = [
    "",
    "no_auto_barriers=true",
    "no_auto_barriers=true,positions_per_step=16384,stages=2",
    "no_auto_barriers=true,ctas_per_sm=4,positions_per_step=4096",
    "layout_name=wgmma,no_auto_barriers=true",
]


def with_top_k(block_max_fn):
    """The candidate ids (``api.select_blocks`` with ``top_k``) on top of a block-max function (scores, n)."""
    return lambda scores, n: api.select_blocks(block_max_fn(scores, n), TOPK, selection="top_k")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variant", action="append", help="mosaic.block_max kwargs, e.g. positions_per_step=4096")
    args = p.parse_args()
    variants = args.variant or DEFAULT_VARIANTS
    header(variants)
    for b, s, t in SHAPES:
        scores = jax.random.normal(jax.random.key(0), (b, s, t), jnp.float32)
        n = jnp.full((b, s), t, jnp.int32) - jnp.arange(b * s, dtype=jnp.int32).reshape(b, s)
        scores = jnp.where(jnp.arange(t) < n[..., None], scores, -jnp.inf)
        run = functools.partial(measure, "block_max", args=(scores, n), shape=(b, s, t),
                                nbytes=scores.size * 4 + scores.size // BLOCK * 4, ops=scores.size, iters=args.iters)
        impls = [("xla", functools.partial(reference.block_max, block_size=BLOCK), {})]
        impls += [("mosaic", functools.partial(mosaic.block_max, block_size=BLOCK, **parse_variant(spec)),
                   {"variant": spec or "default"}) for spec in variants]
        want = want_ids = None
        for impl, fn, extra in impls:
            got = run(impl, fn, want=want, stage="block_max", **extra)
            ids = run(impl, with_top_k(fn), want=want_ids, stage="with_top_k", **extra)
            if impl == "xla":
                want, want_ids = got, ids
                run("xla_copy", lambda x, m: x * 1, nbytes=2 * scores.size * 4, stage="copy")


if __name__ == "__main__":
    main()
