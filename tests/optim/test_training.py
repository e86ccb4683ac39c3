"""A short CPU training run of the tiny model on one fixed batch: every group moves its parameters and the
loss falls at every step (the whole recipe: optimizer, schedule, balance loss, router-bias rule)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsv41_jax.model.moe import RouterBias
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig, balance_loss, label_of, optimizer, router_bias_update
from dsv41_jax.optim import labels as L
from dsv41_jax.optim.labels import path_name

STEPS = 8
B, S = 2, 32
LR = 2e-3  # larger than the release's peak: the run is 8 steps (Muon's update RMS is 0.18·lr per element)


@pytest.fixture(scope="module")
def run(tiny_cfg):
    # a short warm-up so the schedule is exercised
    ocfg = OptimConfig(lr=LR, warmup_steps=2, constant_until=100, decay_until=200, total_steps=300)
    model = Transformer(tiny_cfg, rngs=nnx.Rngs(0))
    graphdef, params, biases, rest = nnx.split(model, nnx.Param, RouterBias, ...)
    tx = optimizer(tiny_cfg, ocfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (B, S + 1)), jnp.int32)
    rows = jnp.asarray(np.stack([rng.integers(0, n, (B, S, tiny_cfg.engram.n_columns))
                                 for n in tiny_cfg.engram.num_embeddings], axis=2), jnp.int32)

    def loss_fn(params, biases):
        logits, aux = nnx.merge(graphdef, params, biases, rest)(tokens[:, :-1], rows, return_aux=True)
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
        return ce + balance_loss(aux.routing, ocfg.seq_balance_alpha), aux.routing

    def apply(params, biases, opt_state, grads, routing):
        updates, opt_state = tx.update(grads, opt_state, params)
        biases = router_bias_update(biases, routing, ocfg.bias_update_speed)
        return optax.apply_updates(params, updates), biases, opt_state

    opt_state = tx.init(params)
    # Two programs instead of one fused step so they compile at once: the forward+backward on a worker
    # thread (XLA releases the GIL) while this thread traces and compiles the optimizer step. On a 2-core
    # CPU that saves most of the optimizer's compile time.
    traced = jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).trace(params, biases)
    with ThreadPoolExecutor(1) as pool:
        grad_step = pool.submit(traced.lower().compile)
        (_, routing), grads = traced.out_info
        apply_step = jax.jit(apply).lower(params, biases, opt_state, grads, routing).compile()
        grad_step = grad_step.result()

    start_params, start_biases, losses = params, biases, []
    for _ in range(STEPS):
        (loss, routing), grads = grad_step(params, biases)
        params, biases, opt_state = apply_step(params, biases, opt_state, grads, routing)
        losses.append(float(loss))
    return losses, start_params, params, start_biases, biases


def test_loss_decreases_at_every_step(run):
    losses = run[0]
    assert np.all(np.isfinite(losses)), losses
    assert np.all(np.diff(losses) < 0), losses
    assert losses[-1] < losses[0] - 1.0, losses


def test_every_group_moves_its_parameters(run):
    """Every group changes its parameters. The indexer's get no LM-loss gradient (hard top-k): they change
    only by decoupled weight decay (all of muon_index_heads). Router biases move by the aux-loss-free rule."""
    _, before, after, biases_before, biases_after = run
    moved, decay = {}, 1 - (1 - LR * OptimConfig().weight_decay) ** STEPS
    for (path, x0), x1 in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after), strict=True):
        name = path_name(path)
        change = float(jnp.abs(x1 - x0).max())
        moved.setdefault(label_of(name), []).append(change)
        if ".indexer." in name:  # decay only: ≤ |W|·(1 − (1 − lr·λ)^steps) (the warm-up makes it loose)
            assert change <= float(jnp.abs(x0).max()) * decay + 1e-7, name
    assert set(moved) == set(L.GROUPS) - {L.NOT_OPTIMIZED}
    for label, changes in moved.items():
        assert max(changes) > 1e-4, label
    bias_change = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), biases_before, biases_after)
    names = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(bias_change)[0]}
    assert all(v > 0 for n, v in names.items() if n.endswith(".bias"))  # text tokens: a step every update
    assert all(v == 0 for n, v in names.items() if n.endswith(".bias_vl"))  # no image tokens in the batch
