"""The mHC Sinkhorn's loop on the device: time and kernels of one site at decode and training shapes.

    python benchmarks/mhc_bench.py [--reps 50]
    python benchmarks/mhc_bench.py --site [--rows 8192]

``matrix``: the normalisations as reductions over a [*, M, M] array in a ``fori_loop`` (each trip a few small
kernels, launched from the host), ``unrolled``: the same written out (``mhc.sinkhorn(..., unroll=True)``), and
``entries``: the arithmetic on the M² entries as separate arrays, so that every normalisation is elementwise
(a trip can be one fused kernel), looped. Forward, and forward + backward, of ``sinkhorn(logits)·w`` summed.
One JSON line per case: median µs of ``--reps`` calls, the fusions in the compiled HLO, the compile time and
the largest difference from ``matrix``.

``--site [--rows 8192]``: a block's two mHC sites at training rows instead (coefficients, collapse, a stand-in
sublayer, expand, then the same for the FFN site; bf16 streams of 4 × 1024), forward and forward + backward,
with collapse and expand as products (CPU's and TPU's form) and written out over the streams (GPU's): profiler
busy time of 5 calls (GPU), kernels a call and compile time; the largest gradient difference between the forms.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import mhc
from pallas_kernels.benchutil import median_us

ITERS, EPS = 20, 1e-6


def entries_form(logits, iters=ITERS, eps=EPS):
    m = logits.shape[-1]
    total = lambda xs: functools.reduce(jnp.add, xs)  # noqa: E731

    def columns(c):
        den = [total([c[i][j] for i in range(m)]) + eps for j in range(m)]
        return [[c[i][j] / den[j] for j in range(m)] for i in range(m)]

    c = []
    for i in range(m):
        e = [jnp.exp(logits[..., i, j] - logits[..., i, :].max(-1)) for j in range(m)]
        c.append([x / total(e) + eps for x in e])
    c = columns(c)

    def trip(_, flat):
        c = [list(flat[i * m:(i + 1) * m]) for i in range(m)]
        c = columns([[x / (total(row) + eps) for x in row] for row in c])
        return tuple(x for row in c for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, trip, tuple(x for row in c for x in row))
    return jnp.stack(flat, axis=-1).reshape(logits.shape)


def site(rows: int, dtype=jnp.bfloat16) -> None:
    from dsv41_jax.config import MHCConfig
    from pallas_kernels import devtime

    rng = np.random.default_rng(0)
    m, d, cfg = 4, 1024, MHCConfig()
    x = jnp.asarray(rng.normal(size=(1, rows, m, d)), dtype)
    pre = jnp.asarray(rng.uniform(0.2, 1, (1, rows, m)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(1, rows, m, d)), jnp.float32)
    params = [(jnp.asarray(rng.normal(size=((2 + m) * m, m * d)) * 0.02, jnp.float32), jnp.zeros(((2 + m) * m,)),
               jnp.ones((3,))) for _ in range(2)]

    def programs():  # new functions each form: the switch is read at trace time
        def block(x, pre, params):
            for fn, base, scale in params:  # attention site, then FFN site; tanh stands in for the sublayer
                p_next, post, comb = mhc.hc_mixes(x, fn, base, scale, cfg, 1e-6)
                x = mhc.expand(jnp.tanh(mhc.collapse(x, pre)), x, post, comb)
                pre = p_next
            return x, pre

        def loss(x, pre, params):
            y, p = block(x, pre, params)
            return jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(p)

        return (("fwd", jax.jit(block)), ("fwd+bwd", jax.jit(jax.grad(loss, argnums=(0, 2)))))

    grads = {}
    for form in ("products", "written out"):
        mhc._written_out = lambda x, f=form: f == "written out"  # noqa: SLF001 -- the bench's switch
        for kind, fn in programs():
            t0 = time.perf_counter()
            fn.lower(x, pre, params).compile()
            row = {"rows": rows, "form": form, "pass": kind, "compile_s": time.perf_counter() - t0}
            if kind == "fwd+bwd":
                grads[form] = jax.tree.leaves(fn(x, pre, params))
            dev = devtime.device_time(fn, x, pre, params, calls=5)
            if dev is not None:
                row |= {"busy_us": dev["busy_us"], "kernels": dev["kernels_per_call"]}
            print(json.dumps(row), flush=True)
    diff = [float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b.astype(jnp.float32)).max())
            for a, b in zip(grads["written out"], grads["products"], strict=True)]
    print(json.dumps({"grad_diff_over_max_per_leaf": diff}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--site", action="store_true", help="a block's two sites at training rows, both forms")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", help="--site: the streams' dtype")
    args = p.parse_args()
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
    if args.site:
        return site(args.rows, jnp.dtype(args.dtype))
    forms = {"matrix": lambda x: mhc.sinkhorn(x, ITERS, EPS), "unrolled": lambda x: mhc.sinkhorn(x, ITERS, EPS, True),
             "entries": entries_form}
    for shape in ((1, 1, 4, 4), (32, 1, 4, 4), (1, 8192, 4, 4)):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 3, jnp.float32)
        w = jnp.arange(16.0).reshape(4, 4)
        base = None
        for name, form in forms.items():
            for kind in ("fwd", "fwd+bwd"):
                fn = form if kind == "fwd" else jax.grad(lambda x, f=form, w=w: (f(x) * w).sum())
                t0 = time.perf_counter()
                compiled = jax.jit(fn).lower(x).compile()
                compile_s = time.perf_counter() - t0
                fusions = len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", compiled.as_text(), re.M))
                out = compiled(x)
                if kind == "fwd" and name == "matrix":
                    base = out
                diff = float(jnp.abs(out - base).max()) if kind == "fwd" else None
                us = median_us(compiled, x, iters=args.reps)
                print(json.dumps({"shape": shape, "form": name, "pass": kind, "us": us, "fusions": fusions,
                                  "compile_s": compile_s, "max_diff_vs_matrix": diff}), flush=True)


if __name__ == "__main__":
    main()
