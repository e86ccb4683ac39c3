"""The served-path simulation against the engine over its packed cache (spec attention §9.3, §9.4).

For one conversation (prompt N = 40, response 15 + <eos>) and cache-hit boundaries before, at and after
ratio-2 group edges (odd hits straddle a group) and candidate-block edges (blocks of 4 entries), the
simulation's response logits equal the engine's: prefix prefill into the packed FP4/MXFP4/FP8 cache, then
``replay_after_hit`` with CED, then the response chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from posttrain_testing import HITS, conversation_batch

from dsv41_jax.engine import default_ced_cut
from dsv41_jax.model.documents import documents
from dsv41_jax.model.kv_store import Visibility
from dsv41_jax.posttrain.evaluate import engine_logits, response_mask, sim_logits
from dsv41_jax.posttrain.replay import draw_hits
from dsv41_jax.scoring import row_rel_l2
from dsv41_jax.testing import CPU_EXACT


@pytest.fixture(scope="module")
def batch(mini_cfg):
    return conversation_batch(mini_cfg)


@CPU_EXACT
def test_simulation_equals_the_engine(mini_model, batch):
    w, v = mini_model.cfg.attention.window_size, mini_model.cfg.vocab_size
    cut = default_ced_cut(mini_model.cfg)
    mask = response_mask(batch)
    sim = np.asarray(sim_logits(mini_model, batch, HITS, cut))[mask].reshape(len(HITS), -1, v)
    eng = engine_logits(mini_model, batch, np.where(HITS > 0, HITS, w), cut)[mask].reshape(sim.shape)
    err = row_rel_l2(sim, eng).reshape(len(HITS), -1)  # [hits, response rows]
    # fp32 agreement (~1e-7 here). A value within an ulp of a QDQ rounding boundary can land on the other
    # grid point on one path and move the rows after it by ~1e-4 (golden README §7): rare, so bounded apart
    assert np.quantile(err, 0.95) < 2e-6 and err.max() < 2e-3, (np.median(err), err.max(axis=1))
    # the approximations are real: each hit serves the response quite differently from a cold prefill
    moved = row_rel_l2(sim[HITS > w], np.broadcast_to(sim[HITS == 0], sim[HITS > w].shape))
    assert moved.reshape(-1, sim.shape[1]).max(axis=1).min() > 3e-2


def test_draw_hits_is_uniform_over_page_boundaries_in_the_prompt():
    n = jnp.asarray(np.repeat([40, 17, 8, 30], 4000), jnp.int32)
    hits = np.asarray(draw_hits(jax.random.key(0), n, 8, 4, 0.75)).reshape(4, -1)
    # prompt 40: multiples of 4 in [8, 40) = 8..36 (8 values); 17: 8, 12, 16; 8: none (always cold); 30: 8..28
    for row, allowed in zip(hits, [range(8, 40, 4), range(8, 17, 4), [], range(8, 30, 4)], strict=True):
        hit = row[row > 0]
        assert set(hit.tolist()) <= set(allowed)
        if allowed:
            assert abs((row > 0).mean() - 0.75) < 0.03
            counts = np.bincount(hit // 4, minlength=max(allowed) // 4 + 1)[np.asarray(allowed) // 4]
            assert np.abs(counts / len(hit) - 1 / len(allowed)).max() < 0.03, counts
        else:
            assert (row == 0).all()


def test_a_replay_floor_is_refused_with_packed_documents(mini_model):
    """The served path's window floor and prefix reuse are per row: packed documents have their own floors."""
    docs = documents(jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="packed documents .* have their own windows"):
        Visibility(docs.positions, docs=docs).with_floor(jnp.zeros((1,), jnp.int32))
