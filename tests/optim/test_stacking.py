"""The optimizer run on stacked groups of same-shaped leaves (``optim.stack_leaves``) equals it
run leaf by leaf, keeps the same state (checkpoints unchanged), and traces into a much smaller program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_testing import run_steps

from dsv41_jax.optim import OptimConfig, optimizer
from dsv41_jax.optim.stacking import Groups, stack_leaves


def _layers(tiny_cfg, n: int = 3) -> dict[str, tuple[int, ...]]:
    """``n`` layers' worth of every optimizer group (Muon per matrix / heads / groups / experts, AdamW with and
    without decay, Sinkhorn on stacked Engram tables), plus one-of-a-kind leaves that stay unstacked."""
    a, e, d, m = tiny_cfg.attention, tiny_cfg.engram, tiny_cfg.dim, tiny_cfg.mhc.hc_mult
    shapes = {"embed.weight": (tiny_cfg.vocab_size, d)}
    for i in range(1, n + 1):
        shapes |= {
            f"layers.{i}.attn.wq_a.weight": (a.q_lora_rank, d),
            f"layers.{i}.attn.wq_b.weight": (a.n_heads * a.head_dim, a.q_lora_rank),
            f"layers.{i}.attn.wo_a.weight": (a.o_groups * a.o_lora_rank, a.n_heads // a.o_groups * a.head_dim),
            f"layers.{i}.ffn.experts.w2.weight": (tiny_cfg.moe.n_routed_experts, d, tiny_cfg.moe.moe_inter_dim),
            f"layers.{i}.attn.q_norm.weight": (a.q_lora_rank,),
            f"layers.{i}.hc_ffn_base": ((2 + m) * m,),
            f"layers.{i}.attn.attn_sink": (a.n_heads,),
            f"layers.{i}.engram.embed.weight": (e.num_embeddings[0], e.head_dim),
        }
    return shapes


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_stacked_optimizer_equals_the_per_leaf_one(tiny_cfg, rng, ns_dtype):
    """Three steps of the whole optimizer, stacked and leaf by leaf: the parameters and every state buffer agree
    (elementwise updates bit for bit; Newton–Schulz and Sinkhorn batched over the stack, so up to summation
    order: 1e-6 of each leaf's largest entry in fp32 — measured 0 on CPU — and the bf16 iteration's rounding,
    1e-2, where its products may batch differently), and the state trees have one structure."""
    shapes = _layers(tiny_cfg)
    w = {k: rng.normal(size=s) * 0.1 for k, s in shapes.items()}
    grads = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(3)]
    cfg = OptimConfig(ns_dtype=ns_dtype)
    stacked, plain = (optimizer(tiny_cfg, cfg.replace(stack_leaves=on), lr=3e-3) for on in (True, False))
    (p1, s1), (p0, s0) = run_steps(stacked, w, grads), run_steps(plain, w, grads)
    assert jax.tree.structure(s1) == jax.tree.structure(s0)
    tol = 1e-6 if ns_dtype == "float32" else 1e-2
    for got, want in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p0, s0)), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape and np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-30)
    assert not any(np.allclose(p1[k], w[k]) for k in w if "sink" not in k)  # every group moved


def test_stacked_update_sees_one_array_per_shape():
    """The wrapped transform's update gets a :class:`Groups` of stacked leaves for the updates, the parameters
    and every parameter-shaped part of its state; scalars in the state (Adam's count) pass through."""
    seen = {}

    def update(updates, state, params):
        seen.update(updates=updates, state=state, params=params)
        return jax.tree.map(lambda u, p: u + p, updates, params), state

    inner = optax.GradientTransformation(lambda p: (jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, p)),
                                         update)
    tree = {"a": jnp.ones((2, 3)), "b": {"c": jnp.full((2, 3), 2.0), "d": jnp.ones(4)}, "e": jnp.ones((2, 3))}
    tx = stack_leaves(inner)
    out, state = tx.update(tree, tx.init(tree), tree)
    assert isinstance(seen["updates"], Groups) and isinstance(seen["params"], Groups)
    assert [g.shape for g in seen["updates"]] == [(3, 2, 3), (1, 4)]
    assert seen["state"][0].shape == () and isinstance(seen["state"][1], Groups)
    assert jax.tree.structure(out) == jax.tree.structure(tree) == jax.tree.structure(state[1])
    np.testing.assert_array_equal(out["b"]["c"], 4.0)
    np.testing.assert_array_equal(out["e"], 2.0)


def test_stacking_shrinks_the_optimizer_program(tiny_cfg, rng):
    """What it is for: the traced update has a fraction of the per-leaf program's operations (40 layers)."""
    shapes = _layers(tiny_cfg, n=40)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}

    def count(on: bool) -> int:
        tx = optimizer(tiny_cfg, OptimConfig(stack_leaves=on))
        state = jax.eval_shape(tx.init, params)
        jaxpr = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(params, state, params)
        return len(jaxpr.jaxpr.eqns)

    stacked, plain = count(True), count(False)
    assert stacked < plain / 3, (stacked, plain)


def test_stacking_by_default_is_off_on_the_cpu_and_on_elsewhere(monkeypatch):
    from dsv41_jax.optim.optimizer import stacked

    assert stacked(OptimConfig(stack_leaves=True)) and not stacked(OptimConfig(stack_leaves=False))
    assert OptimConfig().stack_leaves is None and not stacked(OptimConfig())  # these tests run on the CPU
    for backend, on in (("gpu", True), ("tpu", True), ("cpu", False)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert stacked(OptimConfig()) is on
