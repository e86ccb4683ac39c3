"""``eval-served`` metrics: computed from two real paths, zero when nothing is approximated, and equal to a
numpy evaluation of the same logits when an approximation is on."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from posttrain_testing import HITS, conversation_batch, small_model_dict

from dsv41_jax import config as C
from dsv41_jax.config import CacheQuant
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.posttrain.evaluate import Setting, evaluate, exact_logits, response_mask, sim_logits, with_quant


@pytest.fixture(scope="module")
def small_model():
    return Transformer(C.from_dict(small_model_dict()), rngs=nnx.Rngs(2))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_gap_is_zero_without_approximations_and_matches_numpy_with_replay(small_model):
    batch = conversation_batch(small_model.cfg)
    boundaries = [None, 16, 25]
    rows = evaluate(small_model, [batch], boundaries, [Setting("none", frozenset()),
                                                      Setting("replay", frozenset({"replay"}))])
    table = {(r["setting"], r["boundary"]): r for r in rows}
    assert set(table) == {("none", "cold"), ("replay", "cold"), ("replay", "16"), ("replay", "25")}
    n_tokens = len(HITS) * 16  # 15 response tokens + <eos> per conversation
    # the simulation without approximations runs the training forward's ops, on other chunks of the rows: XLA:CPU
    # may block their products differently, so the gap is fp32 rounding (measured 0 in one process, KL 1.5e-8
    # under pytest's two workers), three orders below the smallest approximation below (replay: KL ~1.6e-3)
    none = table["none", "cold"]
    assert abs(none["dnll"]) < 1e-6 and none["kl"] < 1e-6 and none["agree"] == 1 and none["tokens"] == n_tokens
    # numpy oracle of the replay rows, from the logits of (a) the training forward and (b) the simulation
    exact = with_quant(small_model, CacheQuant(False, False, False))
    a = np.asarray(exact_logits(exact, batch), np.float64)
    mask = response_mask(batch)
    t = np.concatenate([batch.tokens[:, 1:], batch.tokens[:, :1]], axis=1)[mask]
    for boundary in boundaries:
        hit = np.full(len(HITS), boundary or 0)
        b = np.asarray(sim_logits(exact, batch, hit, None), np.float64)
        la, lb = _log_softmax(a)[mask], _log_softmax(b)[mask]
        dnll = (la[np.arange(len(t)), t] - lb[np.arange(len(t)), t]).mean()
        kl = (np.exp(la) * (la - lb)).sum(-1).mean()
        agree = (la.argmax(-1) == lb.argmax(-1)).mean()
        got = table["replay", "cold" if boundary is None else str(boundary)]
        np.testing.assert_allclose([got["dnll"], got["kl"], got["agree"]], [dnll, kl, agree], rtol=1e-4, atol=1e-7)
        assert got["tokens"] == n_tokens
        assert (got["kl"] > 1e-3) == (boundary is not None)  # a hit changes the served path; cold does not
