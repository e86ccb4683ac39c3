"""The indexer KL in the post-training step: with no replay drawn and no CED the served path is the training
forward, so the step's indexer KL, agreement and indexer gradient must equal the pre-training step's
(``train.step``, with documents) on the same rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from posttrain_testing import record_grads, sft_rows, two_layer_model_dict

from dsv41_jax import config as C
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig
from dsv41_jax.optim.labels import path_name
from dsv41_jax.posttrain.config import PosttrainConfig, ReplayConfig
from dsv41_jax.posttrain.step import make_posttrain_step
from dsv41_jax.train.step import TrainState, make_train_step, split_model

PROMPTS, LENGTHS, S = (20, 26), (36, 30), 40
MODEL = two_layer_model_dict()


@pytest.fixture(scope="module")
def setup():
    cfg = C.from_dict(MODEL)
    batch = {k: jnp.asarray(v) for k, v in sft_rows(cfg, PROMPTS, LENGTHS, S).items()}  # one micro-batch
    graphdef, params, biases, rest = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    tx = record_grads()
    state = TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params))
    ocfg = OptimConfig(indexer_kl_weight=0.5)
    return cfg, batch, graphdef, rest, tx, state, ocfg


def _indexer_grads(grads) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    return {path_name(p): np.asarray(g) for p, g in flat if ".indexer." in path_name(p)}


def test_posttrain_indexer_kl_equals_pretraining_without_replay(setup):
    cfg, batch, graphdef, rest, tx, state, ocfg = setup
    plain = PosttrainConfig(replay=ReplayConfig(prob=0.0, ced=False))
    new_p, m_p = jax.jit(make_posttrain_step(graphdef, rest, cfg, ocfg, tx, plain, seed=0))(state, batch)
    batch_t = {k: batch[k] for k in ("tokens", "segment_ids")}
    new_t, m_t = jax.jit(make_train_step(graphdef, rest, cfg, ocfg, tx))(state, batch_t)
    assert float(m_p["hit_frac"]) == 0.0
    np.testing.assert_allclose(float(m_p["indexer_kl"]), float(m_t["indexer_kl"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_p["indexer_agreement"]), float(m_t["indexer_agreement"]), rtol=1e-5)
    assert 0 < float(m_p["indexer_agreement"]) < 1
    g_p, g_t = _indexer_grads(new_p.opt_state), _indexer_grads(new_t.opt_state)
    assert g_p.keys() == g_t.keys() and len(g_p) >= 4, sorted(g_p)
    # the KL is the indexer's only gradient (it is detached and its top-k is hard): equal in both steps,
    # and not zero
    assert sum(np.abs(g).sum() for g in g_p.values()) > 0
    for name in g_p:
        np.testing.assert_allclose(g_p[name], g_t[name], rtol=1e-4, atol=1e-9, err_msg=name)
