"""The train step on packed documents, against a direct computation of its objective on the model:

- the batch's segment ids and positions reach the model (the CE is the model's on those documents, and
  changes when either changes);
- the indexer KL and top-k agreement metrics are the per-query stats aggregated as documented;
- the step rematerialises every block (``remat="block"``) and its gradient equals the plain gradient;
- the indexer KL falls while training.

A 2-layer cut of the tiny model (Full m=2 with Engram, Full m=1 candidate source) keeps compiles short.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsv41_jax.model import Transformer
from dsv41_jax.optim import OptimConfig, balance_loss
from dsv41_jax.train.step import TrainState, make_train_step, split_model, targets_and_mask, token_nll

S = 48
LENS = ((13, 20, 15), (30, 12))  # per row; the second row ends in 6 padding tokens


@pytest.fixture(scope="module")
def cfg2(tiny_cfg):
    a, e, d = tiny_cfg.attention, tiny_cfg.engram, tiny_cfg.dspark
    return tiny_cfg.replace(
        n_layers=2,
        attention=dataclasses.replace(a, compress_ratios=(2, 1, 0, 0, 0), kv_source_layers=(0, 1),
                                      index_source_layers=(0, 1), candidate_source_layer=1),
        engram=dataclasses.replace(e, layer_ids=(0,), num_embeddings=(434,)),
        dspark=dataclasses.replace(d, target_layer_ids=(0, 1)))


def _batch(cfg) -> dict:
    rng = np.random.default_rng(0)
    seg = np.zeros((len(LENS), S), np.int32)
    pos = np.zeros_like(seg)
    for b, lens in enumerate(LENS):
        off = np.cumsum((0,) + lens)
        for d, n in enumerate(lens):
            seg[b, off[d]:off[d + 1]], pos[b, off[d]:off[d + 1]] = d + 1, np.arange(n)
    # a few repeated phrases, so attention has something to find
    phrases = rng.integers(4, cfg.vocab_size, (6, 8))
    tokens = phrases[rng.integers(0, 6, (len(LENS), S // 8))].reshape(len(LENS), S) * (seg > 0)
    rows = rng.integers(0, cfg.engram.num_embeddings[0], (len(LENS), S, 1, cfg.engram.n_columns))
    batch = dict(tokens=tokens, segment_ids=seg, positions=pos, engram_rows=rows.astype(np.int32))
    return {k: jnp.asarray(v)[None] for k, v in batch.items()}  # one micro-batch


def _record_grads() -> optax.GradientTransformation:
    """Passes updates through and keeps the last gradient in its state (to read the step's gradient)."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, _, p=None: (g, g))


@pytest.fixture(scope="module")
def run(cfg2):
    ocfg = OptimConfig(indexer_kl_weight=0.5)
    graphdef, params, biases, rest = split_model(Transformer(cfg2, rngs=nnx.Rngs(0)))
    # the step is under test, not the optimizer: Adam compiles in a fraction of Muon's time
    tx = optax.chain(_record_grads(), optax.adam(1e-2))
    state = TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params))
    step = jax.jit(make_train_step(graphdef, rest, cfg2, ocfg, tx, remat="block"))
    return dict(state=state, step=step, graphdef=graphdef, rest=rest, ocfg=ocfg, batch=_batch(cfg2))


def test_step_sees_the_documents_remats_and_reports_indexer_metrics(run):
    """CE, indexer metrics and the (rematerialised) gradient of the step equal a direct computation."""
    batch, state, ocfg = run["batch"], run["state"], run["ocfg"]
    new, m = run["step"](state, batch)
    mb = {k: v[0] for k, v in batch.items()}
    targets, mask = targets_and_mask(mb["tokens"], mb["segment_ids"])
    real = mb["segment_ids"] > 0

    def objective(params):  # the step's loss, written out, without remat
        model = nnx.merge(run["graphdef"], params, state.biases, run["rest"])
        logits, aux = model(mb["tokens"], mb["engram_rows"], segment_ids=mb["segment_ids"],
                            positions=mb["positions"], return_aux=True, indexer_target="dense")
        ce = (token_nll(logits, targets) * mask).sum() / mask.sum()
        kl = sum(jnp.where(real, s.kl, 0).sum() for s in aux.indexer) / len(aux.indexer) / real.sum()
        bal = balance_loss(aux.routing, ocfg.seq_balance_alpha, real)
        return ce + bal + ocfg.indexer_kl_weight * kl, (ce, aux.indexer)

    (_, (ce, stats)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state.params)
    np.testing.assert_allclose(float(m["ce"]), float(ce), rtol=1e-6)
    real = np.asarray(real)
    kl = np.mean([np.asarray(s.kl)[real].sum() for s in stats]) / real.sum()
    valid = [real & np.asarray(s.valid) for s in stats]
    agree = sum(np.asarray(s.agreement)[v].sum() for s, v in zip(stats, valid, strict=True))
    np.testing.assert_allclose(float(m["indexer_kl"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(m["indexer_agreement"]), agree / sum(v.sum() for v in valid), rtol=1e-5)
    assert len(stats) == 2 and 0 < float(m["indexer_agreement"]) < 1
    step_grads = new.opt_state[0]
    for (path, g), want in zip(nnx.to_flat_state(step_grads), jax.tree.leaves(grads), strict=True):
        # fp32 rounding of two programs (remat or not), relative to each gradient's own scale: an entry 1e-3 of
        # its tensor's largest may be off by ~1e-8 (seen at XLA -O0 on some CPUs: 1.15e-8 on 2.1e-5 of 1.6e-2;
        # on another, through the 20-step Sinkhorn's backward, 1.47e-9 on 1.7e-5 of 1.2e-3: 1.25e-6 of it)
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=4e-6 * np.abs(want).max(), err_msg=str(path))
    # the positions and the segment ids of the batch are what the step used
    moved = dict(batch, positions=batch["positions"] + 3)
    assert abs(float(run["step"](state, moved)[1]["ce"]) - float(ce)) > 1e-4
    merged = dict(batch, segment_ids=(batch["segment_ids"] > 0).astype(jnp.int32),  # one document per row
                  positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), batch["positions"].shape))
    assert abs(float(run["step"](state, merged)[1]["ce"]) - float(ce)) > 1e-4


def test_indexer_kl_falls(run):
    state, kls, ces = run["state"], [], []
    for _ in range(8):
        state, m = run["step"](state, run["batch"])
        kls.append(float(m["indexer_kl"])), ces.append(float(m["ce"]))
    assert np.all(np.diff(kls) < 0) and kls[-1] < 0.7 * kls[0], kls
    assert ces[-1] < ces[0], ces
