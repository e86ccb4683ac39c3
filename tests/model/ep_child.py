"""The multi-device half of ``test_moe_ep.py`` (run with 8 fake CPU devices).

One MoE layer of the tiny config, forward and gradient, expert-parallel on several meshes against the
single-device grouped matmul; then decode-shaped forwards (one token per sequence) of MXFP4 experts on the
gathered path, each device gathering its own experts, against the single-device grouped matmul. Prints one
JSON line per case.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.model.moe import MoE, expert_parallel
from dsv41_jax.train.step import build_mesh


def main():
    cfg = C.tiny().replace(dtype="float32")
    m = cfg.moe
    moe = MoE(m, cfg.dim, m.n_routed_experts, m.n_activated_experts, dtype=jnp.float32, param_dtype=jnp.float32,
              rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    rng = np.random.default_rng(0)

    def loss(state, x, mesh):
        with expert_parallel(mesh):
            y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))  # every output entry weighs

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    for shape, batch in (((1, 1, 2, 1), 4), ((2, 1, 4, 1), 8), ((1, 2, 2, 2), 4), ((1, 1, 8, 1), 1)):
        x = jnp.asarray(rng.standard_normal((batch, 6, cfg.dim)), jnp.float32)
        (v1, (gs1, gx1)) = fn(state, x, None)
        mesh = build_mesh(shape)
        (v2, (gs2, gx2)) = fn(state, x, mesh)
        hlo = fn.lower(state, x, mesh).compile().as_text()
        diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(gs1), jax.tree.leaves(gs2),
                                                                 strict=True))
        print(json.dumps({"mesh": shape, "batch": batch, "value": [float(v1), float(v2)],
                          "grad_x": float(jnp.abs(gx1 - gx2).max()), "grad_params": diff,
                          "grad_scale": float(jnp.abs(gx1).max()),
                          "collectives": sorted(set(re.findall(
                              r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)\b", hlo)))}))
    decode_gathered()


def decode_gathered():
    cfg = C.tiny().replace(dtype="float32", weight_format="native")
    m = cfg.moe
    moe = MoE(m, cfg.dim, m.n_routed_experts, m.n_activated_experts, dtype=jnp.float32, param_dtype=jnp.float32,
              rngs=nnx.Rngs(1), native=True)
    _, state = nnx.split(moe)
    rng = np.random.default_rng(1)
    graphs = {p: nnx.graphdef(MoE(dataclasses.replace(m, routed_path=p), cfg.dim, m.n_routed_experts,
                                  m.n_activated_experts, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(1), native=True)) for p in ("gather", "dense", "grouped")}

    def forward(state, x, mesh, path):
        with expert_parallel(mesh):
            return nnx.merge(graphs[path], state)(x)[0]

    fn = jax.jit(forward, static_argnums=(2, 3))
    for shape, batch in (((1, 1, 8, 1), 1), ((1, 1, 2, 1), 2)):
        x = jnp.asarray(rng.standard_normal((batch, 1, cfg.dim)), jnp.float32)
        want = fn(state, x, None, "grouped")
        for path in ("gather", "dense"):
            step = fn.lower(state, x, build_mesh(shape), path).compile()
            got = step(state, x)
            print(json.dumps({"decode": shape, "path": path, "batch": batch, "err": float(jnp.abs(got - want).max()),
                              "scale": float(jnp.abs(want).max()), "collectives": sorted(set(re.findall(
                                  r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)\b", step.as_text())))}))


if __name__ == "__main__":
    main()
