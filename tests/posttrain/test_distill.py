"""Self-distillation toward the exact path (``posttrain.distill``): the KL and its gradient.

The step's term is ``weight · Σ_response KL(exact_θ ‖ served_θ) / n`` with the teacher detached, so its
gradient is the gradient of ``f(θ') = Σ KL(exact_θ ‖ served_θ') / n`` at ``θ' = θ``. Checked without fake-quant
(whose straight-through gradient is not the derivative of its forward), with encoder replay, which makes the
served path differ from the exact one through continuous functions of the weights only, and with a top-k
that covers every entry (a selection that flips between θ − ε and θ + ε is a jump in f; the MoE routing's
top-k is one too, hence the small ε).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from posttrain_testing import record_grads, sft_rows, two_layer_model_dict

from dsv41_jax import config as C
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig
from dsv41_jax.posttrain.config import DistillConfig, PosttrainConfig, ReplayConfig
from dsv41_jax.posttrain.distill import token_kl
from dsv41_jax.posttrain.replay import ServePlan, served_forward
from dsv41_jax.posttrain.step import make_posttrain_step
from dsv41_jax.train.step import TrainState, split_model

PROMPTS, LENGTHS, S = (20, 26), (36, 30), 40
HIT = 16  # replay granularity 16: the only multiple of 16 in [window 8, N) for both prompts
# every entry covered by the top-k and the candidate pool: no selection flips; exact caches (the STE is not
# a derivative, so finite differences need the unquantised path)
MODEL = two_layer_model_dict(index_topk=48, candidate_topk_blocks=16,
                             cache_quant={"main_kv": False, "index": False, "swa": False})


def test_token_kl_is_zero_at_the_teacher_and_its_gradient_is_p_student_minus_p_teacher():
    rng = np.random.default_rng(0)
    t = jnp.asarray(rng.normal(size=(3, 7)) * 2, jnp.float32)
    s = jnp.asarray(rng.normal(size=(3, 7)) * 2, jnp.float32)
    np.testing.assert_allclose(np.asarray(token_kl(t, t)), 0.0, atol=1e-6)
    kl = np.asarray(token_kl(t, s))
    pt, ps = jax.nn.softmax(t), jax.nn.softmax(s)
    np.testing.assert_allclose(kl, np.sum(pt * (np.log(pt) - np.log(ps)), -1), rtol=1e-5)
    assert (kl > 0).all()
    g = np.asarray(jax.grad(lambda x: token_kl(t, x).sum())(s))
    np.testing.assert_allclose(g, ps - pt, atol=1e-6)
    # central differences (the KL is smooth in the student logits)
    eps = 1e-2
    for i, j in [(0, 0), (1, 3), (2, 6)]:
        d = jnp.zeros_like(s).at[i, j].set(eps)
        fd = (float(token_kl(t, s + d)[i]) - float(token_kl(t, s - d)[i])) / (2 * eps)
        np.testing.assert_allclose(fd, g[i, j], rtol=2e-3, atol=1e-5)
    # a small step against the gradient brings the student toward the teacher
    assert float(token_kl(t, s - 0.1 * g).sum()) < float(token_kl(t, s).sum())


@pytest.fixture(scope="module")
def setup():
    cfg = C.from_dict(MODEL)
    # the KL counts the replayed rows too (any mask will do for the math; these rows move the most)
    batch = {k: jnp.asarray(v) for k, v in sft_rows(cfg, PROMPTS, LENGTHS, S, loss_from=HIT - 8).items()}
    graphdef, params, biases, rest = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    tx = record_grads()
    state = TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params))
    return cfg, batch, (graphdef, params, biases, rest), tx, state


def _step_grads(setup, replay: ReplayConfig, weight: float):
    cfg, batch, (graphdef, _, _, rest), tx, state = setup
    pcfg = PosttrainConfig(replay=replay, distill=DistillConfig(weight))
    new, metrics = jax.jit(make_posttrain_step(graphdef, rest, cfg, OptimConfig(), tx, pcfg, seed=0))(state, batch)
    return new.opt_state, metrics


def test_distill_term_vanishes_when_the_served_path_is_exact(setup):
    """No fake-quant, no replay, no CED: student == teacher, so the KL and its gradient are 0."""
    plain = ReplayConfig(prob=0.0, ced=False)
    g0, m0 = _step_grads(setup, plain, 0.0)
    g1, m1 = _step_grads(setup, plain, 5.0)
    assert "distill_kl" not in m0
    assert abs(float(m1["distill_kl"])) < 1e-6
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_distill_gradient_is_the_detached_teacher_kl_gradient(setup):
    """With encoder replay the served path differs: the step's extra gradient (weight w minus weight 0, over w)
    is ∇f of f(θ') = Σ KL(exact_θ ‖ served_θ') / n, f falls along −∇f, and central differences agree."""
    _, batch, (graphdef, params, biases, rest), _, _ = setup
    replay = ReplayConfig(prob=1.0, granularity=HIT, ced=False)
    w = 10.0
    g0, _ = _step_grads(setup, replay, 0.0)
    g1, m1 = _step_grads(setup, replay, w)
    g_step = jax.tree.map(lambda a, b: (b - a) / w, g0, g1)

    mb = {k: v[0] for k, v in batch.items()}
    mask, n = mb["loss_mask"], mb["loss_mask"].sum()
    teacher = nnx.merge(graphdef, params, biases, rest)(mb["tokens"], None)
    plan = ServePlan(jnp.full((2,), HIT, jnp.int32), mb["prompt_len"])

    @jax.jit
    def f(p):
        logits = served_forward(nnx.merge(graphdef, p, biases, rest), mb["tokens"], None, plan, cut=None)[0]
        return jnp.sum(token_kl(teacher, logits) * mask) / n

    f0 = float(f(params))
    assert f0 > 1e-4  # replay moves the response predictions
    np.testing.assert_allclose(float(m1["distill_kl"]), f0, rtol=1e-5)
    g_ref = jax.grad(f)(params)
    norm = float(optax.tree.norm(g_ref))
    for a, b in zip(jax.tree.leaves(g_step), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3 * norm / np.sqrt(np.asarray(b).size))
    # the directional derivative along the gradient is |∇f|²: central differences and the descent sign
    eps = 1e-3 / norm  # a parameter move of 1e-3: 1e-2 already flips an expert choice
    move = lambda t: jax.tree.map(lambda p, g: p + t * g, params, g_ref)
    fd = (float(f(move(eps))) - float(f(move(-eps)))) / (2 * eps)
    np.testing.assert_allclose(fd, norm**2, rtol=2e-3)
    assert float(f(move(-eps))) < f0 < float(f(move(eps)))
