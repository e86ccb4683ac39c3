"""The routed experts' grouped matmul on the device: ``moe.grouped_matmul``'s implementations, forward and
forward + backward, at a training shape.

    python benchmarks/moe_bench.py [--rows 32768] [--dim 1024] [--inter 384] [--experts 16] [--impls xla,tokamax,pallas]
    python benchmarks/moe_bench.py --layer [--k 4] ...
    python benchmarks/moe_bench.py --tune [--rows 32768] [--dim 1024] [--inter 384] [--experts 16]

Rows are tokens × activated experts (``configs/small.yaml`` at 8K: 8,192 × 4), split evenly over the experts.
For each implementation: compile time and the median of 10 synchronised calls of the forward (``x @ w``,
bf16 operands, fp32 output) and of the gradient of ``sum(out · cot)`` with respect to both operands;
TFLOP/s count 2·rows·dim·inter for the forward and three times that for forward + backward. One JSON line each.

``--layer``: the whole routed path of one layer instead (``moe.routed_experts``, path ``grouped``: the sort by
expert, the token copies, the three grouped products with the clamped SwiGLU and the weighted sum back to
tokens), ``rows / k`` tokens of ``k`` picks drawn at random, forward and the gradient of ``sum(out · cot)`` with
respect to the tokens, the routing weights and the three expert matrices; TFLOP/s count the three products.
Run it with another tree first on ``PYTHONPATH`` for a before / after of the layer's code. ``--kernels N`` (GPU):
also the forward + backward's N costliest kernels from a profiler trace (µs a call, XLA's kernel names), and
``--hlo DIR`` writes its optimized HLO there: what each fusion fuses, and its layouts.

``--tune`` (GPU): ``pallas_kernels.grouped_matmul``'s blocks, warps and stages over a grid, for each product of a
layer's forward and backward (the fused gate and up projection ``dim -> 2·inter``, the down projection
``inter -> dim``, their input gradients and weight gradients): one JSON line a product with the kernel's device
time (profiler, 10 calls) and TFLOP/s at the best settings, and its time at the defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.moe import grouped_matmul


def timed(fun, *args, iters: int = 10) -> tuple[float, float]:
    t0 = time.perf_counter()
    compiled = jax.jit(fun).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return compile_s, float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--impls", default="xla,tokamax,pallas")
    p.add_argument("--layer", action="store_true", help="time the whole routed path of one layer")
    p.add_argument("--k", type=int, default=4, help="picks per token (--layer)")
    p.add_argument("--kernels", type=int, default=0, help="--layer on GPU: list the N costliest kernels")
    p.add_argument("--hlo", default=None, help="--layer: write the forward + backward's optimized HLO here")
    p.add_argument("--tune", action="store_true", help="sweep the Pallas kernels' blocks (GPU)")
    a = p.parse_args()
    if a.layer:
        return layer(a)
    if a.tune:
        return tune(a)
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(a.rows, a.dim)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(a.experts, a.dim, a.inter)) * a.dim ** -0.5, jnp.bfloat16)
    sizes = jnp.full((a.experts,), a.rows // a.experts, jnp.int32)
    cot = jnp.asarray(rng.normal(size=(a.rows, a.inter)), jnp.float32)
    flops = 2 * a.rows * a.dim * a.inter
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": a.rows, "dim": a.dim,
                      "inter": a.inter, "experts": a.experts}), flush=True)
    ref = None
    for impl in a.impls.split(","):
        row = {"impl": impl}
        try:
            fwd = lambda x, w, i=impl: grouped_matmul(x, w, sizes, i)  # noqa: E731
            grad = jax.grad(lambda x, w, i=impl: jnp.sum(grouped_matmul(x, w, sizes, i) * cot), argnums=(0, 1))
            c_f, t_f = timed(fwd, lhs, rhs)
            c_b, t_b = timed(grad, lhs, rhs)
            out = [np.asarray(x, np.float32) for x in (jax.jit(fwd)(lhs, rhs), *jax.jit(grad)(lhs, rhs))]
            ref = ref or out
            err = [float(np.abs(o - r).max() / np.abs(r).max()) for o, r in zip(out, ref, strict=True)]
            row |= {"fwd_compile_s": c_f, "fwd_ms": t_f * 1e3, "fwd_TFLOPs": flops / t_f / 1e12,
                    "fwd_bwd_compile_s": c_b, "fwd_bwd_ms": t_b * 1e3, "fwd_bwd_TFLOPs": 3 * flops / t_b / 1e12,
                    "max_rel_err_vs_first": err}
        except Exception as err:  # noqa: BLE001 -- an implementation that fails here is a result
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


def layer(a) -> None:
    from flax import nnx

    from dsv41_jax.model.moe import Experts, routed_experts

    rng = np.random.default_rng(0)
    t = a.rows // a.k
    x = jnp.asarray(rng.normal(size=(t, a.dim)), jnp.bfloat16)
    picks = jnp.asarray(np.argsort(rng.random((t, a.experts)), axis=1)[:, :a.k], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, a.k)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(t, a.dim)), jnp.float32)
    graphdef, state = nnx.split(Experts(a.experts, a.dim, a.inter, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    flops = 3 * 2 * t * a.k * a.dim * a.inter
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "tokens": t, "k": a.k,
                      "dim": a.dim, "inter": a.inter, "experts": a.experts, "layer": True}), flush=True)
    for impl in a.impls.split(","):
        row = {"impl": impl}
        try:
            # the picks and the cotangent are arguments: as closed-over constants XLA would fold the sort and
            # the cotangent's gathers into the program, which a training step cannot
            def fwd(st, x, w, picks, i=impl):
                return routed_experts(x, picks, w, nnx.merge(graphdef, st), 10.0, implementation=i, path="grouped")

            grad = jax.grad(lambda st, x, w, p, c: jnp.sum(fwd(st, x, w, p) * c), argnums=(0, 1, 2))
            c_f, t_f = timed(fwd, state, x, weights, picks)
            c_b, t_b = timed(grad, state, x, weights, picks, cot)
            row |= kernels(jax.jit(grad), (state, x, weights, picks, cot), a, impl)
            row |= {"fwd_compile_s": c_f, "fwd_ms": t_f * 1e3, "fwd_TFLOPs": flops / t_f / 1e12,
                    "fwd_bwd_compile_s": c_b, "fwd_bwd_ms": t_b * 1e3, "fwd_bwd_TFLOPs": 3 * flops / t_b / 1e12}
        except Exception as err:  # noqa: BLE001 -- an implementation that fails here is a result
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


def tune(a) -> None:
    import itertools

    from pallas_kernels import devtime
    from pallas_kernels import grouped_matmul as gm

    rng = np.random.default_rng(0)
    sizes = jnp.full((a.experts,), a.rows // a.experts, jnp.int32)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    d, i2, i = a.dim, 2 * a.inter, a.inter
    products = [  # name, kernel, operands, (X, Y)
        ("up_fwd", gm.rows_matmul, (arr(a.rows, d), arr(a.experts, d, i2))),
        ("up_dx", gm.rows_matmul, (arr(a.rows, i2), arr(a.experts, i2, d))),
        ("up_dw", gm.weights_matmul, (arr(a.rows, d), arr(a.rows, i2))),
        ("down_fwd", gm.rows_matmul, (arr(a.rows, i), arr(a.experts, i, d))),
        ("down_dx", gm.rows_matmul, (arr(a.rows, d), arr(a.experts, d, i))),
        ("down_dw", gm.weights_matmul, (arr(a.rows, i), arr(a.rows, d))),
    ]
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": a.rows, "dim": d,
                      "inter": i, "experts": a.experts, "tune": True}), flush=True)
    default = {"rows": (gm.BM, gm.BN, gm.BK, gm.WARPS, gm.STAGES),
               "weights": (gm.W_BX, gm.W_BY, gm.W_BK, gm.W_WARPS, gm.W_STAGES)}
    for name, kernel, (lhs, rhs) in products:
        kind = "rows" if kernel is gm.rows_matmul else "weights"
        flops = 2 * a.rows * lhs.shape[1] * (rhs.shape[2] if kind == "rows" else rhs.shape[1])
        results = {}

        def run(settings, kernel=kernel, lhs=lhs, rhs=rhs, results=results):
            if settings in results:
                return
            fn = functools.partial(kernel, sizes=sizes, **dict(zip(_TUNE_KEYS, settings, strict=True)))
            try:
                d = devtime.device_time(jax.jit(lambda x, w, fn=fn: fn(x, w)), lhs, rhs, calls=10)
                results[settings] = sum(v for k, v in d["top"].items() if k.startswith("grouped_")) * 1e-6 or None
            except Exception:  # noqa: BLE001 -- settings the compiler refuses (shared memory) are skipped
                results[settings] = None  # as a profile that saw no kernel: no measurement, never the best

        # two stages: the blocks at the default warps and stages, then warps and stages at the best blocks
        base = default[kind]
        run(base)
        for bm, bn, bk in itertools.product((64, 128), (64, 128, 256), (32, 64)):
            run((bm, bn, bk, *base[3:]))
        timed_ok = lambda results=results: [k for k in results if results[k]]  # noqa: E731
        if not timed_ok():
            print(json.dumps({"product": name, "error": "no settings timed (profiler or compiler)"}), flush=True)
            continue
        best = min(timed_ok(), key=results.get)
        for warps, stages in itertools.product((4, 8), (2, 3, 4)):
            run((*best[:3], warps, stages))
        best = min(timed_ok(), key=results.get)
        row = {"product": name, "kernel": kind, "flops": flops, "best": dict(zip(_TUNE_KEYS, best, strict=True)),
               "best_us": results[best] * 1e6, "best_TFLOPs": flops / results[best] / 1e12,
               "default_us": results[base] and results[base] * 1e6, "tried": len(results)}
        print(json.dumps(row), flush=True)


_TUNE_KEYS = ("bm", "bn", "bk", "warps", "stages")


def kernels(fn, args, a, impl: str) -> dict:
    """``--hlo``: the optimized HLO of ``fn`` into a file; ``--kernels``: its costliest kernels on a GPU."""
    out = {}
    if a.hlo:
        from pathlib import Path

        path = Path(a.hlo) / f"moe_layer_fwd_bwd_{impl}.hlo.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fn.lower(*args).compile().as_text())
        out["hlo"] = str(path)
    if a.kernels:
        from pallas_kernels import devtime

        d = devtime.device_time(fn, *args, calls=5)
        if d is not None:
            costly = sorted(d["last_call"], key=lambda r: -r[1])[:a.kernels]
            out |= {"busy_us": d["busy_us"], "kernels_per_call": d["kernels_per_call"], "costliest_us": costly}
    return out


if __name__ == "__main__":
    main()
