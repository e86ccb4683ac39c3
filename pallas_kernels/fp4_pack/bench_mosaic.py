"""fp4_pack timings at the bench.py shapes: XLA reference, the Triton kernel (gpu.py), a device copy of
the input (its own bytes: the copy ceiling at this size) and Mosaic GPU variants (mosaic.py), one JSON
line each.

Run on the device: ``python -m pallas_kernels.fp4_pack.bench_mosaic [--variant k=v,k=v ...]``. Each
``--variant`` is a set of ``mosaic.pack`` keyword arguments; the default list tries barrier settings,
occupancy, register passes and the two layouts. Each Mosaic variant is compared with the XLA output
(``exact``); one that fails prints an ``error`` line and the run goes on. ``pipelined_us`` is the time
per call of ``--iters`` calls issued back to back, next to benchutil's per-call median.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bench_variants import header, measure, parse_variant
from pallas_kernels.fp4_pack import gpu, layout, mosaic, reference
from pallas_kernels.fp4_pack.bench import OPS_PER_ELEMENT, SHAPES

DEFAULT_VARIANTS = [
    "",
    "no_auto_barriers=true",
    "no_auto_barriers=true,stages=2,step_bytes=32768",
    "no_auto_barriers=true,stages=4,step_bytes=16384",
    "no_auto_barriers=true,ctas_per_sm=3,stages=2,step_bytes=16384",
    "no_auto_barriers=true,chunk=256",
    "layout_name=wgmma,no_auto_barriers=true",
]
_REF = {"nvfp4": reference.pack_nvfp4, "mxfp4": reference.pack_mxfp4}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variant", action="append", help="mosaic.pack kwargs, e.g. rows_per_step=16,stages=2")
    p.add_argument("--shapes", default="", help="comma-separated indices into bench.SHAPES (default: all)")
    p.add_argument("--skip-triton", action="store_true")
    args = p.parse_args()
    variants = args.variant or DEFAULT_VARIANTS
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    header(variants)
    for fmt, rows, n in shapes:
        x = jax.random.normal(jax.random.key(0), (rows, n), jnp.dtype(args.dtype))
        moved = x.size * x.dtype.itemsize + x.size // 2 + x.size // layout.FORMATS[fmt]
        run = functools.partial(measure, "fp4_pack", args=(x,), shape=(rows, n), nbytes=moved,
                                ops=OPS_PER_ELEMENT * x.size, iters=args.iters, fmt=fmt, dtype=args.dtype)
        want = run("xla", _REF[fmt])
        run("xla_copy", lambda v: v * 1, nbytes=2 * x.size * x.dtype.itemsize)
        if not args.skip_triton:
            run("triton", functools.partial(gpu.pack, fmt=fmt), want=want)
        for spec in variants:
            run("mosaic", functools.partial(mosaic.pack, fmt=fmt, **parse_variant(spec)), want=want,
                variant=spec or "default")


if __name__ == "__main__":
    main()
