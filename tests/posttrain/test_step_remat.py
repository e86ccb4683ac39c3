"""``remat`` in the post-training step means what it means in pre-training: each transformer block of the
served forward (and of the LM rows' training forward) is rematerialised, with the model's policy, and the
step's metrics and gradient do not change. The step on SFT + LM rows (``lm_weight`` 0.5, a cache hit drawn
for every row, CED) also reports its LM CE as the model's packed-document CE of those rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from posttrain_testing import record_grads, sft_rows, two_layer_model_dict

from dsv41_jax import config as C
from dsv41_jax.model.transformer import REMAT, Transformer
from dsv41_jax.optim import OptimConfig
from dsv41_jax.posttrain.config import PosttrainConfig, ReplayConfig
from dsv41_jax.posttrain.step import make_posttrain_step, posttrain_objective
from dsv41_jax.train.step import TrainState, split_model, targets_and_mask, token_nll

PROMPTS, LENGTHS, S = (20, 26), (36, 30), 40
MODEL = two_layer_model_dict()
PCFG = PosttrainConfig(replay=ReplayConfig(prob=1.0), lm_weight=0.5)


def _lm_rows(cfg) -> dict:
    """Two packed rows: documents of 24 and 12 tokens, then 4 padding tokens."""
    rng = np.random.default_rng(4)
    seg = np.repeat([[1] * 24 + [2] * 12 + [0] * 4], 2, axis=0).astype(np.int32)
    pos = np.repeat([list(range(24)) + list(range(12)) + [0] * 4], 2, axis=0).astype(np.int32)
    tokens = (rng.integers(4, cfg.vocab_size, seg.shape) * (seg > 0)).astype(np.int32)
    return {"lm_tokens": tokens[None], "lm_segment_ids": seg[None], "lm_positions": pos[None]}


@pytest.fixture(scope="module")
def setup():
    cfg = C.from_dict(MODEL)
    batch = {k: jnp.asarray(v) for k, v in (sft_rows(cfg, PROMPTS, LENGTHS, S) | _lm_rows(cfg)).items()}
    graphdef, params, biases, rest = split_model(Transformer(cfg, rngs=nnx.Rngs(0)))
    tx = record_grads()
    state = TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params))
    return cfg, batch, (graphdef, params, biases, rest), tx, state


CHECKPOINT = jax.make_jaxpr(jax.checkpoint(lambda x: x))(1.0).jaxpr.eqns[0].primitive


def _checkpoints(jaxpr) -> list:
    """The ``jax.checkpoint`` equations of a jaxpr, looking into nested jaxprs (not into checkpoints)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is CHECKPOINT:
            out.append(eqn)
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _checkpoints(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _checkpoints(sub)
    return out


@pytest.mark.parametrize("remat", ["none", "block", "dots"])
def test_every_block_of_the_served_and_lm_forwards_is_rematerialised(setup, remat):
    cfg, batch, (graphdef, params, biases, rest), _, _ = setup
    loss = posttrain_objective(cfg, OptimConfig(), PCFG, remat).loss
    key = jax.random.key(0)

    def checkpoints(keys):
        mb = {k: batch[k][0] for k in keys}
        fn = lambda p: loss(nnx.merge(graphdef, p, biases, rest), mb, key).sums
        return _checkpoints(jax.make_jaxpr(fn)(params).jaxpr)

    sft = checkpoints(["tokens", "segment_ids", "prompt_len", "loss_mask"])
    lm = checkpoints(["lm_tokens", "lm_segment_ids", "lm_positions"])
    if remat == "none":
        assert not sft and not lm
        return
    assert len(sft) >= cfg.n_layers and len(lm) == cfg.n_layers  # the served pass runs every block (after pass 1)
    assert all(e.params["policy"] is REMAT[remat] for e in sft + lm)


def test_remat_changes_no_metric_or_gradient(setup):
    cfg, batch, (graphdef, params, biases, rest), tx, state = setup
    ocfg = OptimConfig()
    out = {remat: jax.jit(make_posttrain_step(graphdef, rest, cfg, ocfg, tx, PCFG, seed=0, remat=remat))(state, batch)
           for remat in ("none", "block")}
    (plain, m0), (remat, m1) = out["none"], out["block"]
    assert float(m0["hit_frac"]) == 1.0
    for k in m0:
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(plain.opt_state), jax.tree.leaves(remat.opt_state), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-8)
    # the LM rows' CE is the model's own over their documents, and the CE mixes it in at lm_weight
    mb = {k: v[0] for k, v in batch.items()}
    logits = jax.jit(lambda t, s, p: nnx.merge(graphdef, params, biases, rest)(t, segment_ids=s, positions=p))(
        mb["lm_tokens"], mb["lm_segment_ids"], mb["lm_positions"])
    targets, mask = targets_and_mask(mb["lm_tokens"], mb["lm_segment_ids"])
    np.testing.assert_allclose(float(m0["lm_ce"]), float((token_nll(logits, targets) * mask).sum() / mask.sum()),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m0["ce"]), 0.5 * float(m0["sft_ce"]) + 0.5 * float(m0["lm_ce"]), rtol=1e-6)
