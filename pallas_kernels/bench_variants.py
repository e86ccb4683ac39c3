"""Shared by the bench_mosaic.py scripts: variant parsing, pipelined timing, one guarded measurement."""

from __future__ import annotations

import json
import time
import traceback

import jax
import numpy as np

from pallas_kernels import benchutil, devtime


def parse_variant(spec: str) -> dict:
    """'k=v,k=v' -> kwargs (ints, true/false and strings)."""
    out = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    return out


def pipelined_us(fn, *args, iters: int = 20) -> float:
    """Time per call of ``iters`` calls issued back to back, blocking once at the end."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / iters * 1e6


def same_bytes(a, b) -> bool:
    """Two pytrees of arrays hold the same bytes (NaNs compare by bit pattern)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(la, lb, strict=True))


def measure(kernel: str, impl: str, fn, args: tuple, shape, nbytes: int, ops: int, *, iters: int, want=None,
            **extra):
    """jit ``fn``, check it against ``want`` (``exact`` field), time it, print one JSON line; on any error
    print an ``error`` line instead and return None, so one failing variant does not end the run."""
    try:
        f = jax.jit(fn)
        got = f(*args)
        if want is not None:
            extra["exact"] = same_bytes(got, want)
        us = benchutil.median_us(f, *args, iters=iters)
        extra["pipelined_us"] = round(pipelined_us(f, *args, iters=iters), 2)
        dev = devtime.device_time(f, *args, calls=iters)
        if dev is not None:  # GPU: the kernels' own time, free of the host's dispatch rate
            extra["devtime"] = dev
        benchutil.emit(kernel, impl, shape, us, nbytes, ops, **extra)
        return got
    except Exception as e:  # noqa: BLE001 - report and go on
        print(json.dumps({"kernel": kernel, "impl": impl, "shape": list(shape), **extra,
                          "error": f"{type(e).__name__}: {str(e)[:2000]}",
                          "where": traceback.format_exc(limit=4)[-2000:]}), flush=True)
        return None


def header(variants) -> None:
    print(json.dumps({"jax": jax.__version__, "device": str(jax.devices()[0]), "variants": variants}), flush=True)


def summarize(paths) -> None:
    """One short line per JSON record of the given bench outputs (errors cut to their first line)."""
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                if "kernel" not in r:
                    print(f"# {r}")
                    continue
                tag = f"{r['kernel']:9s} {r['impl']:8s} {str(r.get('variant', '')):55s} {str(r['shape']):16s} " \
                      f"{r.get('fmt', r.get('stage', '')):10s}"
                if "error" in r:
                    print(f"{tag} ERROR {r['error'].splitlines()[0][:160]}")
                else:
                    dev = r.get("devtime") or {}
                    print(f"{tag} {r['median_us']:9.1f} us  pipelined {r['pipelined_us']:9.1f} us  "
                          f"device {dev.get('busy_us') or 0:8.1f} us / {dev.get('kernels_per_call', 0):5.1f} "
                          f"kernels  {r['gb_per_s']:7.1f} GB/s  floor x{r['fraction_of_floor']:.2f}  "
                          f"exact={r.get('exact', '-')}")


if __name__ == "__main__":
    import sys

    summarize(sys.argv[1:])
