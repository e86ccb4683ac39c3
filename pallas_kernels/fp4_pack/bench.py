"""fp4_pack timings at cache-write shapes: XLA reference vs the Pallas kernel, one JSON line each.

Run on the device: ``python -m pallas_kernels.fp4_pack.bench``. Floor = bytes moved (read latents,
write nibbles + scale bytes) / copy bandwidth; the issue's target is >= 80% of it and faster than XLA.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels import benchutil
from pallas_kernels.fp4_pack import api, layout

# (format, rows, lanes): main-KV writes from 4K to 128K entries x 512; index keys x 128
SHAPES = [("nvfp4", r, 512) for r in (4096, 16384, 131072)] + [("mxfp4", r, 128) for r in (4096, 131072)]
OPS_PER_ELEMENT = 40  # integer/compare ops of the encode per element (order of magnitude, for the op floor)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    for fmt, rows, n in SHAPES:
        x = jax.random.normal(jax.random.key(0), (rows, n), jnp.dtype(args.dtype))
        moved = x.size * x.dtype.itemsize + x.size // 2 + x.size // layout.FORMATS[fmt]
        fn = api.pack_nvfp4 if fmt == "nvfp4" else api.pack_mxfp4
        for backend in api.BACKENDS:
            f = jax.jit(lambda x, fn=fn, backend=backend: fn(x, backend=backend))
            us = benchutil.median_us(f, x, iters=args.iters)
            benchutil.emit("fp4_pack", backend, (rows, n), us, moved, OPS_PER_ELEMENT * x.size, fmt=fmt,
                           dtype=args.dtype)


if __name__ == "__main__":
    main()
