"""The optimizer's update (with ``apply_updates``) for a config's whole parameter tree: traced operations,
compile time, HLO size and, on an accelerator, the time of one call; per-leaf against stacked
(``optim.stack_leaves``).

    python benchmarks/optim_bench.py [CONFIG] [--modes per-leaf,stacked] [--iters 5]

Parameters are drawn at random in their dtypes (fp32 for ``configs/small.yaml``: 1.23 B, 4.9 GB; the state
adds as much again per buffer), gradients too. Each mode compiles in its own ``jit``; one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax

from dsv41_jax.optim import optimizer
from dsv41_jax.optim.memory import abstract_params
from dsv41_jax.train.config import load


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default="configs/small.yaml")
    p.add_argument("--modes", default="per-leaf,stacked")
    p.add_argument("--iters", type=int, default=5, help="timed calls (0: compile only; the default on CPU)")
    a = p.parse_args()
    cfg = load(a.config, [])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params(cfg.model))
    run = a.iters if jax.default_backend() != "cpu" else 0
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "config": a.config,
                      "leaves": len(jax.tree.leaves(shapes)),
                      "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))}), flush=True)
    for mode in a.modes.split(","):
        tx = optimizer(cfg.model, cfg.optim.replace(stack_leaves=mode == "stacked"))
        state = jax.eval_shape(tx.init, shapes)

        def step(g, s, p, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        t0 = time.perf_counter()
        eqns = len(jax.make_jaxpr(step)(shapes, state, shapes).jaxpr.eqns)
        lowered = jax.jit(step, donate_argnums=(1, 2)).lower(shapes, state, shapes)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        row = {"mode": mode, "traced_ops": eqns, "trace_lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
               "hlo_lines": len(compiled.as_text().splitlines())}
        if run:
            draw = lambda x: jax.random.normal(jax.random.key(0), x.shape, x.dtype) * 0.01  # noqa: E731
            params, grads = jax.tree.map(draw, shapes), jax.tree.map(draw, shapes)
            st = jax.jit(tx.init)(params)
            times = []
            for _ in range(run + 1):
                t = time.perf_counter()
                params, st = compiled(grads, st, params)
                jax.block_until_ready(params)
                times.append(time.perf_counter() - t)
            row["step_ms"] = round(float(np.median(times[1:])) * 1e3, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
