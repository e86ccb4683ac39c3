"""block_max timings: XLA reference vs the Pallas pass, alone and with the XLA top_k, one JSON line each.

Run on the device: ``python -m pallas_kernels.block_max.bench``. Each line has the median of single
synchronised calls (``median_us``, with the launch and host round trip) and ``pipelined_us`` (calls issued
back to back: the device time); ``exact`` compares each selection's ids with the first (XLA, top_k).
Floor = score bytes read (+ maxima written) / copy bandwidth.
The issue's XLA baseline (block max + top_k(2048) on [8, 2^20]) was 0.34 ms.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bench_variants import measure
from pallas_kernels.block_max import api, radix_cluster, radix_mosaic, select

BLOCK, TOPK = 8, 2048  # candidate_block_size, candidate_topk_blocks of the release (spec attention §6)
# (B, S, T): prefill-like 8 queries over 1M positions; decode batches of one query each
SHAPES = [(8, 1, 1 << 20), (128, 1, 1 << 17), (32, 1, 1 << 20)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default="", help="comma-separated indices into SHAPES (default: all)")
    p.add_argument("--impls", default="", help="comma-separated block-max impls: xla, pallas (default: all)")
    args = p.parse_args()
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    impls = {b: functools.partial(api.block_max, backend=b) for b in api.BACKENDS}  # pallas: Mosaic GPU on GPU
    if args.impls:
        impls = {name: impls[name] for name in args.impls.split(",")}
    for b, s, t in shapes:
        scores = jax.random.normal(jax.random.key(0), (b, s, t), jnp.float32)
        n = jnp.full((b, s), t, jnp.int32) - jnp.arange(b * s, dtype=jnp.int32).reshape(b, s)
        scores = jnp.where(jnp.arange(t) < n[..., None], scores, -jnp.inf)
        moved = scores.size * 4 + scores.size // BLOCK * 4
        run = functools.partial(measure, "block_max", args=(scores, n), shape=(b, s, t), nbytes=moved,
                                ops=scores.size, iters=args.iters)
        want = want_ids = None
        for name, fn in impls.items():
            got = run(name, lambda x, n, fn=fn: fn(x, n, BLOCK), stage="block_max", want=want)
            want = got if want is None else want
            for sel, kw in SELECTIONS.items():
                ids = run(name, lambda x, n, fn=fn, kw=kw: api.select_blocks(fn(x, n, BLOCK), TOPK, **kw),
                          stage=f"with_{sel}", want=want_ids)
                want_ids = ids if want_ids is None else want_ids
        # the selection alone, from the block maxima
        bmax = api.block_max(scores, n, BLOCK)
        want = {}
        for sel, fn in SELECT_ONLY.items():
            kind = "search" if sel.startswith("search") else "select"  # each compared with its kind's first
            got = measure("select", "xla", fn, args=(bmax,), shape=bmax.shape, nbytes=bmax.size * 4,
                          ops=bmax.size, iters=args.iters, stage=sel, want=want.get(kind))
            want.setdefault(kind, got)


# radix: the XLA passes; radix_kernel: the threshold search in Mosaic GPU kernels (what backend="pallas" takes
# on GPU), the faster for the shape of radix_passes (a kernel a pass) and radix_cluster (one kernel)
SELECTIONS = {"top_k": dict(selection="top_k"), "radix": dict(selection="radix")}
if jax.default_backend() == "gpu":
    SELECTIONS.update({s: dict(selection=s) for s in ("radix_kernel", "radix_passes", "radix_cluster")})
# the selection alone
SELECT_ONLY = {"top_k": lambda m: api.select_blocks(m, TOPK, selection="top_k"),
               "radix": lambda m: api.select_blocks(m, TOPK, selection="radix")}
if jax.default_backend() == "gpu":  # interpreted elsewhere: minutes at these shapes
    for _s in ("radix_kernel", "radix_passes", "radix_cluster"):
        SELECT_ONLY[_s] = functools.partial(lambda m, s: api.select_blocks(m, TOPK, selection=s), s=_s)
    # the threshold search alone: XLA passes, a kernel a pass, one kernel
    SELECT_ONLY["search_xla"] = lambda m: select.kth_largest_key(select.order_key(m.reshape(-1, m.shape[-1])), TOPK)
    SELECT_ONLY["search_passes"] = lambda m: radix_mosaic.kth_largest_key(m.reshape(-1, m.shape[-1]), TOPK)
    SELECT_ONLY["search_cluster"] = lambda m: radix_cluster.kth_largest_key(m.reshape(-1, m.shape[-1]), TOPK)


if __name__ == "__main__":
    main()
