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
from pallas_kernels.block_max import api, select

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
        run = functools.partial(measure, "block_max", args=(scores, n), shape=(b, s, t), nbytes=moved,
                                ops=scores.size, iters=args.iters)
        want = None
        for backend in api.BACKENDS:
            run(backend, lambda x, n, backend=backend: api.block_max(x, n, BLOCK, backend=backend),
                stage="block_max")
            for name, kw in SELECTIONS.items():
                got = run(backend, lambda x, n, backend=backend, kw=kw: api.candidate_block_ids(
                    x, n, BLOCK, TOPK, backend=backend, **kw), stage=f"with_{name}", want=want)
                want = got if want is None else want
        # the selection alone, from the block maxima
        bmax = api.block_max(scores, n, BLOCK)
        for name, kw in SELECTIONS.items():
            measure("select", "xla", lambda m, kw=kw: _select(m, **kw), args=(bmax,), shape=bmax.shape,
                    nbytes=bmax.size * 4, ops=bmax.size, iters=args.iters, stage=name)


SELECTIONS = {"top_k": dict(selection="top_k"), "radix4": dict(selection="radix", digit_bits=4),
              "radix8": dict(selection="radix", digit_bits=8)}


def _select(bmax, selection: str, digit_bits: int = 4):
    if selection == "radix":
        return select.select_top_blocks(bmax, TOPK, digit_bits=digit_bits)
    nb = bmax.shape[-1]
    vals, idx = jax.lax.top_k(bmax, min(TOPK, nb))
    return jnp.sort(jnp.where(vals > -jnp.inf, idx, nb), axis=-1)


if __name__ == "__main__":
    main()
