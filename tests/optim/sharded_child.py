"""The 8-device half of ``test_sharded.py``: a script run with 8 fake CPU devices (started by conftest.py).

Prints one JSON line: Sinkhorn directions sharded vs on one device; the whole optimizer's parameters after
two sharded vs two single-device steps; how the optimizer state is sharded.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsv41_jax import config as C
from dsv41_jax.checkpoint.tree import flat_variables
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.optim import OptimConfig, opt_state_partition_specs, optimizer, sinkhorn_direction
from dsv41_jax.sharding import logical_to_mesh

# one parameter of every group, with the tiny model's shapes and logical axes
NAMES = ["embed.weight", "head.weight", "layers.1.engram.embed.weight", "layers.4.engram.embed.weight",
         "layers.2.attn.wq_b.weight", "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.wo_a.weight",
         "layers.2.ffn.experts.w1.weight", "layers.2.ffn.gate.weight", "layers.2.attn_norm.weight",
         "layers.2.hc_attn_base"]


def sinkhorn_layouts(mesh, rng) -> dict:
    """Δ of one table with rows over all 8 devices, and with rows over 4 × features over 2."""
    cfg = OptimConfig(ns_dtype="float32")  # layouts compared at fp32 rounding
    f = jax.jit(lambda n: sinkhorn_direction(n, tau=cfg.sinkhorn_tau, iters=cfg.sinkhorn_iters, eps=cfg.sinkhorn_eps))
    n = rng.normal(size=(1024, 64)).astype(np.float32) * rng.lognormal(0, 1, (1024, 1)).astype(np.float32)
    n[rng.random(1024) < 0.3] = 0.0
    want = np.asarray(f(jax.device_put(n, jax.devices()[0])))
    out = {}
    for name, spec in {"rows/8": P(("fsdp", "expert", "tensor"), None),
                       "rows/4 x features/2": P(("fsdp", "expert"), "tensor")}.items():
        x = jax.device_put(n, NamedSharding(mesh, spec))
        out["table " + name] = {"diff": float(np.abs(np.asarray(f(x)) - want).max()),
                                "all_reduce": "all-reduce" in f.lower(x).compile().as_text()}
    return out


def whole_optimizer(mesh, rng) -> dict:
    model_cfg = C.tiny()
    variables = flat_variables(abstract_model(model_cfg))
    shapes = {k: variables[k].get_value().shape for k in NAMES}
    specs = {k: logical_to_mesh(tuple(variables[k].get_metadata()["out_sharding"]), shape=shapes[k], mesh=mesh)
             for k in NAMES}
    params = {k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in shapes.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    tx = optimizer(model_cfg, OptimConfig(ns_dtype="float32"), lr=1e-2)
    named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=lambda x: isinstance(x, P))
    shardings = (named(specs), named(opt_state_partition_specs(tx, params, specs)))

    def step(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    def run(put, init, step):
        p = put(params)
        state = first = init(p)
        for g in grads:
            p, state = step(p, state, put(g))
        return p, first

    one = jax.devices()[0]
    single, _ = run(lambda t: jax.device_put(t, one), jax.jit(tx.init), jax.jit(step))
    # as a train step would: outputs pinned to the parameters' and the state's specs
    sharded, state = run(lambda t: jax.device_put(t, shardings[0]), jax.jit(tx.init, out_shardings=shardings[1]),
                         jax.jit(step, out_shardings=shardings))
    out = {"params": {k: {"diff": float(np.abs(np.asarray(sharded[k]) - np.asarray(single[k])).max()),
                          "scale": float(np.abs(np.asarray(single[k]) - params[k]).max()),
                          "same_sharding": sharded[k].sharding.is_equivalent_to(shardings[0][k], len(shapes[k]))}
                      for k in NAMES}}
    bad, buffers = [], 0
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        owner = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in NAMES]
        if owner:
            buffers += 1
            if not x.sharding.is_equivalent_to(shardings[0][owner[0]], x.ndim):
                bad.append(f"{jax.tree_util.keystr(path)} {x.sharding.spec}")
    out["state"] = {"buffers": buffers, "mismatched": bad}
    return out


def main():
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    rng = np.random.default_rng(0)
    print(json.dumps(sinkhorn_layouts(mesh, rng) | whole_optimizer(mesh, rng)))


if __name__ == "__main__":
    main()
