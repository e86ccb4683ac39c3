"""Timing and floors shared by the kernels' bench.py scripts (one JSON line per measurement)."""

from __future__ import annotations

import json
import time

import jax
import numpy as np

COPY_BYTES_PER_S = 2.8e12  # notes/PLATFORM.md: H200 device copy through JAX, read + write
# No measured vector (non-tensor-core) rate in PLATFORM.md: the H200 datasheet fp32 figure stands in for
# the elementwise / integer op rate. Treat the op floor as indicative; the byte floor is the binding one.
VECTOR_OPS_PER_S = 67e12


def median_us(fn, *args, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def median_us_carry(fn, carry, *args, iters: int = 20, warmup: int = 3) -> float:
    """Like :func:`median_us` for ``carry = fn(carry, *args)`` with ``carry`` donated (an in-place update:
    each call consumes the previous call's output)."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(fn(carry, *args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def emit(kernel: str, impl: str, shape, us: float, bytes_moved: int, ops: int, **extra) -> None:
    floor_bytes_us = bytes_moved / COPY_BYTES_PER_S * 1e6
    floor_ops_us = ops / VECTOR_OPS_PER_S * 1e6
    print(json.dumps({
        "kernel": kernel, "impl": impl, "shape": list(shape), "device": jax.devices()[0].device_kind,
        "median_us": round(us, 2), "gb_per_s": round(bytes_moved / us / 1e3, 1),
        "floor_bytes_us": round(floor_bytes_us, 2), "floor_ops_us": round(floor_ops_us, 2),
        "fraction_of_floor": round(max(floor_bytes_us, floor_ops_us) / us, 3), **extra,
    }), flush=True)
