"""fp4_pack timings at the bench.py shapes: XLA reference, a device copy of the input (its own bytes: the
copy ceiling at this size) and Mosaic GPU variants (mosaic.py, and direct.py with ``--direct``), one JSON
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms
from pallas_kernels.bench_variants import header, measure, parse_variant
from pallas_kernels.fp4_pack import direct, layout, mosaic, reference
from pallas_kernels.fp4_pack.bench import OPS_PER_ELEMENT, SHAPES
from pallas_kernels.fp4_pack.mosaic_encode import to_kernel_input

DEFAULT_VARIANTS = [  # against the default (16 KB tiles, 2 stages, 3 CTAs/SM, 256-group passes, no auto barriers)
    "",
    "no_auto_barriers=false",
    "chunk=128",
    "stages=3",
    "stages=2,step_bytes=32768",
    "ctas_per_sm=4",
    "layout_name=wgmma",
    "encode=bsearch",
    "encode=swar",
]
_REF = {"nvfp4": reference.pack_nvfp4, "mxfp4": reference.pack_mxfp4}


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "stages", "ctas_per_sm", "chunk"))
def stream_copy(x, fmt: str, *, rows_per_step: int = 16, stages: int = 2, ctas_per_sm: int = 3, chunk: int = 128):
    """The packer's streaming loop with the encode taken out: each tile's words go SMEM -> registers (the
    packer's layout) -> SMEM -> GMEM unchanged. Its time is the ceiling of ``mosaic.pack`` at these
    settings; the gap between the two is the encode."""
    block = layout.FORMATS[fmt]
    xin, _ = to_kernel_input(x, block)  # bf16: [R, G, P] words
    r, g, p = xin.shape
    br = rows_per_step
    bm = br * g
    reg = ms.rows_layout(p)
    n_tiles = -(-r // br)
    n_ctas = min(n_tiles, ctas_per_sm * ms.num_sms())
    rows = functools.partial(pl.ds, size=br)

    def body(x_gmem, o_gmem, x_buf, o_buf, barrier):
        def load(t, slot):
            plgpu.copy_gmem_to_smem(x_gmem.at[rows(t * br)], x_buf.at[slot], barrier.at[slot])

        def store(t, buf):
            plgpu.copy_smem_to_gmem(o_buf.at[buf], o_gmem.at[rows(t * br)])

        def compute(t, slot, buf):
            xs, os_ = x_buf.at[slot].reshape(bm, p), o_buf.at[buf].reshape(bm, p)

            def one(i, carry):
                sl = pl.ds(i * chunk, chunk)
                os_.at[sl][...] = ms.load(xs.at[sl], reg)
                return carry

            jax.lax.fori_loop(0, bm // chunk, one, 0)

        ms.stream(n_tiles=n_tiles, n_ctas=n_ctas, stages=stages, barrier=barrier, load=load, compute=compute,
                  store=store)

    scratch = [plgpu.SMEM((stages, br, g, p), jnp.int32), plgpu.SMEM((2, br, g, p), jnp.int32),
               plgpu.Barrier(num_arrivals=1, num_barriers=stages)]
    return ms.kernel(body, out_type=jax.ShapeDtypeStruct(xin.shape, jnp.int32), scratch_types=scratch,
                     n_ctas=n_ctas, interpret=False, no_auto_barriers=True)(xin)


@functools.partial(jax.jit, static_argnames=("fmt", "groups_per_cta"))
def direct_probe(x, fmt: str, *, groups_per_cta: int = 256):
    """``direct.pack``'s loads and stores with the encode taken out (each group's low word bytes and a zero
    scale are stored): the ceiling of the SMEM-less structure."""
    block = layout.FORMATS[fmt]
    xin, _ = to_kernel_input(x, block)
    r, g, p = xin.shape
    m = r * g
    xin = xin.reshape(m, p)
    reg = ms.rows_layout(p)

    def body(x_gmem, codes_gmem, scales_gmem):
        base = jax.lax.axis_index(ms.CTA_AXIS) * groups_per_cta
        chunks = [pl.ds(base + i * 128, 128) for i in range(groups_per_cta // 128)]
        words = [plgpu.load(x_gmem.at[sl], (), layout=reg, optimized=False) for sl in chunks]
        for sl, w in zip(chunks, words, strict=True):
            codes_gmem.at[sl][...] = w.astype(jnp.uint8)
            scales_gmem.at[sl][...] = jnp.max(w, axis=1).astype(jnp.uint8)

    return plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((m, p), jnp.uint8), jax.ShapeDtypeStruct((m,), jnp.uint8)),
                        grid=(m // groups_per_cta,), grid_names=(ms.CTA_AXIS,),
                        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))(xin)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variant", action="append", help="mosaic.pack kwargs, e.g. rows_per_step=16,stages=2")
    p.add_argument("--shapes", default="", help="comma-separated indices into bench.SHAPES (default: all)")
    p.add_argument("--stream-copy", action="append", help="time stream_copy with these kwargs (bf16 only)")
    p.add_argument("--direct", action="append", help="time direct.pack with these kwargs (e.g. groups_per_cta=512)")
    p.add_argument("--direct-probe", action="append", help="time direct_probe with these kwargs (bf16 only)")
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
        if args.stream_copy and x.dtype == jnp.bfloat16:
            for spec in args.stream_copy:
                run("mosaic_stream_copy", functools.partial(stream_copy, fmt=fmt, **parse_variant(spec)),
                    nbytes=2 * x.size * x.dtype.itemsize, variant=spec)
        for spec in variants:
            run("mosaic", functools.partial(mosaic.pack, fmt=fmt, **parse_variant(spec)), want=want,
                variant=spec or "default")
        for spec in args.direct_probe or [] if x.dtype == jnp.bfloat16 else []:
            run("direct_probe", functools.partial(direct_probe, fmt=fmt, **parse_variant(spec)), variant=spec)
        for spec in args.direct or []:
            run("direct", functools.partial(direct.pack, fmt=fmt, **parse_variant(spec)), want=want,
                variant=spec or "default")


if __name__ == "__main__":
    main()
