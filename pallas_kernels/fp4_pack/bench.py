"""fp4_pack timings: XLA reference vs the Pallas kernel for pack, unpack and the fused cache write, one
JSON line each (``op`` says which).

Run on the device: ``python -m pallas_kernels.fp4_pack.bench [--ops pack,unpack,write]``. Floor = bytes
moved / copy bandwidth: pack reads latents and writes nibbles + scale bytes; unpack the reverse; the
write reads the new rows and writes their packed bytes into the cache (the untouched cache is not
moved: both implementations update the donated cache in place). Write lines carry ``exact`` (the same
cache bytes as XLA's) and, on GPU, ``devtime`` (device time from a profiler trace of the donated-cache
loop) and ``pack_then_scatter``, the GPU write before the fused kernel. The issue's target is >= 80% of the
floor and faster than XLA.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchutil, devtime
from pallas_kernels.fp4_pack import api, direct, layout, reference

# (format, rows, lanes): main-KV writes from 4K to 128K entries x 512; index keys x 128
SHAPES = [("nvfp4", r, 512) for r in (4096, 16384, 131072)] + [("mxfp4", r, 128) for r in (4096, 131072)]
# unpack: the engine's reads: top-512 main-KV rows of 8 / 128 decoding sequences, a 128K index-key scan
UNPACK_SHAPES = [("nvfp4", 8 * 512, 512), ("nvfp4", 128 * 512, 512), ("mxfp4", 131072, 128)]
# write (format, batch, new rows per sequence, cache slots per sequence, lanes): decode steps and a prefill
WRITE_SHAPES = [("nvfp4", 128, 1, 65536, 512), ("nvfp4", 1, 16384, 131072, 512), ("mxfp4", 128, 1, 65536, 128),
                ("mxfp4", 1, 16384, 131072, 128)]
OPS_PER_ELEMENT = 40  # integer/compare ops of the encode per element (order of magnitude, for the op floor)
DECODE_OPS_PER_ELEMENT = 12  # bit assembly of value and scale, one multiply


def _impls(op: str, fmt: str):
    """(name, function) pairs with the api's signature: XLA and the api's kernel ("pallas": Mosaic GPU on
    GPU)."""
    return [(b, functools.partial(getattr(api, f"{op}_{fmt}"), backend=b)) for b in api.BACKENDS]


def _packed_bytes(fmt: str, elements: int) -> int:
    return elements // 2 + elements // layout.FORMATS[fmt]


def bench_pack(dtype, iters: int) -> None:
    for fmt, rows, n in SHAPES:
        x = jax.random.normal(jax.random.key(0), (rows, n), dtype)
        moved = x.size * x.dtype.itemsize + _packed_bytes(fmt, x.size)
        for backend, impl in _impls("pack", fmt):
            f = jax.jit(impl)
            us = benchutil.median_us(f, x, iters=iters)
            benchutil.emit("fp4_pack", backend, (rows, n), us, moved, OPS_PER_ELEMENT * x.size, fmt=fmt,
                           dtype=jnp.dtype(dtype).name, op="pack")


def bench_unpack(dtype, iters: int) -> None:
    for fmt, rows, n in UNPACK_SHAPES:
        x = jax.random.normal(jax.random.key(0), (rows, n), jnp.float32)
        packed = (api.pack_nvfp4 if fmt == "nvfp4" else api.pack_mxfp4)(x)
        moved = _packed_bytes(fmt, x.size) + x.size * jnp.dtype(dtype).itemsize
        for backend, impl in _impls("unpack", fmt):
            f = jax.jit(functools.partial(impl, dtype=dtype))
            us = benchutil.median_us(f, *packed, iters=iters)
            benchutil.emit("fp4_pack", backend, (rows, n), us, moved, DECODE_OPS_PER_ELEMENT * x.size, fmt=fmt,
                           dtype=jnp.dtype(dtype).name, op="unpack")


def bench_write(dtype, iters: int) -> None:
    for fmt, b, s, t, n in WRITE_SHAPES:
        x = jax.random.normal(jax.random.key(0), (b, s, n), dtype)
        index = (jnp.arange(s, dtype=jnp.int32)[None] * 7 + jnp.arange(b, dtype=jnp.int32)[:, None]) % t
        g = n // layout.FORMATS[fmt]
        moved = x.size * x.dtype.itemsize + _packed_bytes(fmt, x.size) + index.size * 4
        impls = _impls("write", fmt)
        if jax.default_backend() == "gpu":  # the GPU write before the fused kernel: the pack, then XLA's scatter
            def unfused(cc, sc, x, i, fmt=fmt):
                codes, scales = direct.pack(x, fmt)
                return reference.write_rows(cc, codes, i), reference.write_rows(sc, scales, i)

            impls.append(("pack_then_scatter", unfused))
        shapes = (((b, t, n // 2), jnp.uint8), ((b, t, g), jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8))

        def caches(shapes=shapes):
            return tuple(jnp.zeros(shape, dt) for shape, dt in shapes)

        want = None
        for backend, impl in impls:
            f = jax.jit(lambda c, x, i, impl=impl: impl(*c, x, i), donate_argnums=0)
            got = jax.tree.map(np.asarray, f(caches(), x, index))
            want = got if want is None else want  # the first impl is XLA's
            exact = all(np.array_equal(a.view(np.uint8), w.view(np.uint8)) for a, w in zip(got, want, strict=True))
            us = benchutil.median_us_carry(f, caches(), x, index, iters=iters)
            dev = devtime.device_time_carry(f, caches(), x, index, calls=iters)
            extra = {"devtime": dev} if dev is not None else {}
            benchutil.emit("fp4_pack", backend, (b, s, t, n), us, moved, OPS_PER_ELEMENT * x.size, fmt=fmt,
                           dtype=jnp.dtype(dtype).name, op="write", exact=exact, **extra)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16", help="latent dtype: pack/write input, unpack output")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ops", default="pack,unpack,write")
    args = p.parse_args()
    runs = {"pack": bench_pack, "unpack": bench_unpack, "write": bench_write}
    for op in args.ops.split(","):
        runs[op](jnp.dtype(args.dtype), args.iters)


if __name__ == "__main__":
    main()
