"""On 8 fake CPU devices the sharded optimizer equals the unsharded one (spec model §9.3: Sinkhorn norms are
global over row and feature shards), and its state shards like the parameters.

A child process, because this one has already initialised JAX with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv41_jax import config as C
    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.optim import OptimConfig, optimizer, sinkhorn_direction, state_partition_specs
    from dsv41_jax.sharding import logical_to_mesh

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    one = jax.devices()[0]
    rng = np.random.default_rng(0)
    out = {}

    # Sinkhorn alone, with rows over 8 devices and with rows over 4 x features over 2
    cfg = OptimConfig()
    f = jax.jit(lambda n: sinkhorn_direction(n, tau=cfg.sinkhorn_tau, iters=cfg.sinkhorn_iters,
                                             eps=cfg.sinkhorn_eps))
    n = rng.normal(size=(1024, 64)).astype(np.float32) * rng.lognormal(0, 1, (1024, 1)).astype(np.float32)
    n[rng.random(1024) < 0.3] = 0.0
    want = np.asarray(f(jax.device_put(n, one)))
    for name, spec in {"rows/8": P(("fsdp", "expert", "tensor"), None),
                       "rows/4 x features/2": P(("fsdp", "expert"), "tensor")}.items():
        x = jax.device_put(n, NamedSharding(mesh, spec))
        hlo = f.lower(x).compile().as_text()
        out["table " + name] = {"diff": float(np.abs(np.asarray(f(x)) - want).max()),
                                "all_reduce": "all-reduce" in hlo}

    # the whole optimizer on one tiny parameter of every group, two steps
    model_cfg = C.tiny()
    names = ["embed.weight", "head.weight", "layers.1.engram.embed.weight", "layers.4.engram.embed.weight",
             "layers.2.attn.wq_b.weight", "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.wo_a.weight",
             "layers.2.ffn.experts.w1.weight", "layers.2.ffn.gate.weight", "layers.2.attn_norm.weight",
             "layers.2.hc_attn_base"]
    variables = flat_variables(abstract_model(model_cfg))
    shapes = {k: variables[k].get_value().shape for k in names}
    specs = {k: logical_to_mesh(tuple(variables[k].get_metadata()["out_sharding"]), shape=shapes[k], mesh=mesh)
             for k in names}
    params = {k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in shapes.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    tx = optimizer(model_cfg, OptimConfig(), lr=1e-2)
    state_specs = state_partition_specs(tx, params, specs)
    to_named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=lambda x: isinstance(x, P))

    def run(put, init):
        p = put(params, specs)
        state = init(p)
        first = state
        update = jax.jit(tx.update)
        for g in grads:
            u, state = update(put(g, specs), state, p)
            p = optax.apply_updates(p, u)
        return p, first, state

    single, _, _ = run(lambda t, s: jax.device_put(t, one), jax.jit(tx.init))
    sharded, first, last = run(lambda t, s: jax.device_put(t, to_named(s)),
                               jax.jit(tx.init, out_shardings=to_named(state_specs)))
    out["params"] = {k: {"diff": float(np.abs(np.asarray(sharded[k]) - np.asarray(single[k])).max()),
                         "scale": float(np.abs(np.asarray(single[k]) - params[k]).max()),
                         "same_sharding": sharded[k].sharding.is_equivalent_to(
                             NamedSharding(mesh, specs[k]), len(shapes[k]))} for k in names}

    def mismatched(state):
        bad, buffers = [], 0
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            owner = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in names]
            if owner:
                buffers += 1
                if not x.sharding.is_equivalent_to(NamedSharding(mesh, specs[owner[0]]), x.ndim):
                    bad.append(jax.tree_util.keystr(path) + " " + str(x.sharding.spec))
        return {"buffers": buffers, "mismatched": bad}

    out["state after init"], out["state after 2 updates"] = mismatched(first), mismatched(last)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight_devices() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["rows/8", "rows/4 x features/2"])
def test_sharded_sinkhorn_equals_unsharded(eight_devices, layout):
    r = eight_devices["table " + layout]
    assert r["all_reduce"]  # the norms really were combined across devices
    assert r["diff"] < 1e-5, r  # entries of Δ are O(1): fp32 reduction-order noise only


def test_sharded_optimizer_equals_unsharded(eight_devices):
    for name, r in eight_devices["params"].items():
        assert r["same_sharding"], name
        assert r["diff"] <= 1e-6 * max(r["scale"], 1e-3) + 1e-7, (name, r)


@pytest.mark.parametrize("when", ["after init", "after 2 updates"])
def test_optimizer_state_shards_like_its_parameters(eight_devices, when):
    s = eight_devices["state " + when]
    assert not s["mismatched"], s["mismatched"]
    assert s["buffers"] == 9 + 2 * 2  # one buffer each for 9 Muon/Sinkhorn params, two for 2 AdamW params
