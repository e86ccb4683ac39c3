"""The whole-model transform: each group's update through ``optimizer()`` equals its numpy formula, AdamW's
too, and the state's PartitionSpecs follow the parameters'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from optim_testing import run_steps

from dsv41_jax import config as C
from dsv41_jax.optim import OptimConfig, adamw, opt_state_partition_specs, optimizer, param_labels
from dsv41_jax.sharding import state_partition_specs as param_partition_specs

LR = 3e-3


def _run(tx, params: dict, grads: list[dict]) -> dict:
    return run_steps(tx, params, grads)[0]


def test_adamw_two_steps_match_numpy(rng):
    for wd in (0.1, 0.0):
        w, g1, g2 = rng.normal(size=(3, 24))
        got = _run(adamw(OptimConfig(), wd, lr=LR), {"w": w}, [{"w": g1}, {"w": g2}])["w"]
        want, m, v = ref.adamw_step(w, g1, 0 * w, 0 * w, 1, lr=LR, wd=wd)
        want, _, _ = ref.adamw_step(want, g2, m, v, 2, lr=LR, wd=wd)
        np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.fixture(scope="module")
def tiny_group_samples(tiny_cfg):
    """One parameter of every group, with the tiny config's shapes and checkpoint names."""
    a, e = tiny_cfg.attention, tiny_cfg.engram
    d, m = tiny_cfg.dim, tiny_cfg.mhc.hc_mult
    return {
        "layers.2.attn.wq_a.weight": (a.q_lora_rank, d),
        "layers.2.attn.wq_b.weight": (a.n_heads * a.head_dim, a.q_lora_rank),
        "layers.2.attn.indexer.wq_b.weight": (a.index_n_heads * a.index_head_dim, a.q_lora_rank),
        "layers.2.attn.wo_a.weight": (a.o_groups * a.o_lora_rank, a.n_heads // a.o_groups * a.head_dim),
        "layers.2.ffn.experts.w2.weight": (tiny_cfg.moe.n_routed_experts, d, tiny_cfg.moe.moe_inter_dim),
        "embed.weight": (tiny_cfg.vocab_size, d),
        "layers.1.engram.embed.weight": (e.num_embeddings[0], e.head_dim),
        "layers.2.attn.q_norm.weight": (a.q_lora_rank,),
        "layers.1.engram.q_weight": (m, d),
        "layers.2.hc_ffn_base": ((2 + m) * m,),
        "layers.2.attn.attn_sink": (a.n_heads,),
    }


def test_every_group_through_the_whole_optimizer_matches_numpy(tiny_cfg, tiny_group_samples, rng):
    cfg = OptimConfig(ns_dtype="float32")  # the numpy reference is exact
    a = tiny_cfg.attention
    w = {k: rng.normal(size=s) * 0.1 for k, s in tiny_group_samples.items()}
    grads = [{k: rng.normal(size=s) for k, s in tiny_group_samples.items()} for _ in range(2)]
    got = _run(optimizer(tiny_cfg, cfg, lr=LR), w, grads)
    blocks = {"layers.2.attn.wq_b.weight": a.n_heads, "layers.2.attn.indexer.wq_b.weight": a.index_n_heads,
              "layers.2.attn.wo_a.weight": a.o_groups}
    for name, w0 in w.items():
        g1, g2 = grads[0][name], grads[1][name]
        if name.endswith(("wq_a.weight", "wq_b.weight", "wo_a.weight", "experts.w2.weight")):
            step = lambda w, g, m, n=name: ref.muon_step(w, g, m, lr=LR, blocks=blocks.get(n, 1))
        elif name.endswith("embed.weight"):
            step = lambda w, g, m, n=name: ref.sinkhorn_step(w, g, m, lr=LR, lr_mult=5.0 if "engram" in n else 1.0)
        else:
            wd = 0.1 if name.endswith(("norm.weight", "q_weight")) else 0.0
            w1, m, v = ref.adamw_step(w0, g1, 0 * w0, 0 * w0, 1, lr=LR, wd=wd)
            want = ref.adamw_step(w1, g2, m, v, 2, lr=LR, wd=wd)[0]
            np.testing.assert_allclose(got[name], want, rtol=2e-6, atol=1e-8, err_msg=name)  # atol: cancellation
            continue
        w1, m = step(w0, g1, np.zeros_like(w0))
        want = step(w1, g2, m)[0]
        np.testing.assert_allclose(got[name], want, atol=2e-6, rtol=0, err_msg=name)


def test_router_biases_get_no_update_if_passed(rng):
    tx = optimizer(C.tiny())
    params = {"layers.0.ffn.gate.bias": jnp.ones(8), "layers.0.ffn.gate.bias_vl": jnp.ones(8)}
    upd, _ = tx.update({k: jnp.ones(8) for k in params}, tx.init(params), params)
    assert all((np.asarray(u) == 0).all() for u in upd.values())


def test_state_specs_follow_parameter_specs(tiny_cfg, tiny_params):
    params = tiny_params
    tx = optimizer(tiny_cfg)
    specs = opt_state_partition_specs(tx, params, param_partition_specs(params))
    state = jax.eval_shape(tx.init, params)
    pspecs = dict(nnx.to_flat_state(param_partition_specs(params)))
    is_spec = lambda x: isinstance(x, P)
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    assert len(flat_specs) == len(jax.tree.leaves(state))
    buffers = 0
    for path, spec in flat_specs:
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        param_keys = keys[1:]  # the first dict key is the group label of optax.partition
        if param_keys in pspecs:
            assert spec == pspecs[param_keys], (path, spec)
            buffers += 1
        else:
            assert spec == P(), path  # counters
    # Muon and Sinkhorn: one buffer per parameter; AdamW: two
    labels = jax.tree.leaves(param_labels(params))
    assert buffers == sum(2 if lab.startswith("adamw") else 0 if lab == "not_optimized" else 1 for lab in labels)
