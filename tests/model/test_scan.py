"""The scanned stack (``scan_layers``) against the unrolled one, and the plan of repeated layer groups.

``Transformer.run_layers`` runs each run of structurally identical layer groups as one ``lax.scan`` over the
groups' stacked parameters. It must compute what the unrolled loop computes: the same routing and top-k
decisions, the loss, and every parameter's gradient to fp32 rounding (the two programs are fused differently
by XLA, so sums are reassociated; nothing else may differ).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.model.transformer import Schedule, Transformer, segments


def test_release_plan():
    """The release's 40 layers become 14 traced blocks: Engram and Full layers alone, Reuse runs scanned, and the
    ratio-1 part as four (3 × Reuse + Reindex) groups and a last Reuse run."""
    plan = segments(C.v41_flash(), Schedule())
    assert plan == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 5), (8, 1, 1), (9, 1, 5), (14, 1, 1), (15, 1, 5),
                    (20, 1, 1), (21, 4, 4), (37, 1, 3)]
    assert sum(p for _, p, _ in plan) == 14
    covered = [i for first, p, r in plan for i in range(first, first + p * r)]
    assert covered == list(range(40))


def test_schedule_layers_stand_alone():
    """A layer where the schedule acts (CED stop / narrow, the truncation floor) is never inside a scan."""
    cfg = C.v41_flash()
    for sch in (Schedule(stop=26), Schedule(narrow=20), Schedule(truncate=30)):
        at = {sch.stop, sch.narrow, sch.truncate} - {None}
        plan = segments(cfg, sch)
        assert all(first in at or not (first <= a < first + p * r) for first, p, r in plan for a in at), (sch, plan)
        assert [i for first, p, r in plan for i in range(first, first + p * r)] == list(range(40))
    assert segments(cfg, Schedule(), scan=False) == [(i, 1, 1) for i in range(40)]


@pytest.fixture(scope="module")
def both():
    """Loss, gradients, routing and indexer KL of one fp32 forward + backward of the tiny model without Engram
    and fake quantisation
    (so layers 0–1 are one scan, 2–5 a (Full, Reuse) pair whose first group creates the main KV and top-k the
    carry then holds, so it runs on its own before the scan of the rest, and 7–10 two (Reuse, Reindex)
    groups), scanned and unrolled, over two packed documents per row."""
    cfg = C.tiny().replace(dtype="float32")
    # fake quantisation off: the two programs' ~1e-7 reassociation differences would otherwise move a few
    # FP4 / FP8 codes across their rounding boundaries (golden README §7) and the KL of the queries after them
    quant = C.CacheQuant(main_kv=False, index=False, swa=False)
    cfg = cfg.replace(engram=dataclasses.replace(cfg.engram, layer_ids=(), num_embeddings=()),
                      attention=dataclasses.replace(cfg.attention, cache_quant=quant))
    assert segments(cfg, Schedule()) == [(0, 1, 2), (2, 2, 2), (6, 1, 1), (7, 2, 2), (11, 1, 1)]
    rng = np.random.default_rng(0)
    b, s = 2, 48
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 30 + [2] * 18], b, 0), jnp.int32)
    out = {}
    for scan in (True, False):
        c = dataclasses.replace(cfg, scan_layers=scan)
        graphdef, state = nnx.split(Transformer(c, rngs=nnx.Rngs(0)))

        def loss(state, graphdef=graphdef):
            logits, aux = nnx.merge(graphdef, state)(tokens, segment_ids=seg, return_aux="routing",
                                                     indexer_target="dense")
            value = jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + sum(jnp.mean(r.scores ** 2) for r in aux.routing)
            value = value + sum(jnp.mean(st.kl) for st in aux.indexer)
            return value, ([r.experts for r in aux.routing], [st.kl for st in aux.indexer])

        (value, (experts, kl)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        out[scan] = value, experts, kl, grads
    return out


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_scanned_equals_unrolled(both):
    (v1, e1, kl1, g1), (v0, e0, kl0, g0) = both[True], both[False]
    assert len(e1) == len(e0) == C.tiny().n_layers
    for a, b in zip(e1, e0, strict=True):
        np.testing.assert_array_equal(a, b)  # every routing decision
    for a, b in zip(kl1, kl0, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    worst = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g0), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(b).max()
        if scale > 0:
            worst[jax.tree_util.keystr(path)] = np.abs(a - b).max() / scale
    assert len(worst) > 100
    # fp32 reassociation only: observed ≤ 1.3e-5 (mHC scale gradients, sums over every row)
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
