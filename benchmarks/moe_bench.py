"""The routed experts' grouped matmul on the device: ``moe.grouped_matmul``'s implementations, forward and
forward + backward, at a training shape.

    python benchmarks/moe_bench.py [--rows 32768] [--dim 1024] [--inter 384] [--experts 16] [--impls xla,tokamax]

Rows are tokens × activated experts (``configs/small.yaml`` at 8K: 8,192 × 4), split evenly over the experts.
For each implementation: compile time and the median of 10 synchronised calls of the forward (``x @ w``,
bf16 operands, fp32 output) and of the gradient of ``sum(out · cot)`` with respect to both operands;
TFLOP/s count 2·rows·dim·inter for the forward and three times that for forward + backward. One JSON line each.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--impls", default="xla,tokamax")
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
