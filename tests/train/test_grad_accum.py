"""Gradient accumulation: two micro-batches of 2 rows give the step of one batch of the same 4 rows."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax.optim import OptimConfig
from dsv41_jax.train.step import build_mesh, init_state


def micro() -> C.ModelConfig:
    """A 4-layer tiny variant that keeps every layer role (SWA, ratio-2 source, ratio-1 source, Reuse)."""
    t = C.tiny()
    attention = dataclasses.replace(t.attention, compress_ratios=(0, 2, 1, 1, 0, 0, 0), kv_source_layers=(1, 2),
                                    index_source_layers=(1, 2, 3), candidate_source_layer=2)
    return t.replace(n_layers=4, dtype="float32", attention=attention,
                     engram=dataclasses.replace(t.engram, layer_ids=(0, 3)),
                     dspark=dataclasses.replace(t.dspark, target_layer_ids=(1, 2, 3)))


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_accumulated_step_equals_the_full_batch_step():
    cfg = micro()
    ocfg = OptimConfig(lr=2e-3, warmup_steps=2, constant_until=100, decay_until=200, total_steps=300,
                       adam_eps=1e-6, seq_balance_alpha=1e-2, ns_dtype="float32")  # fp32: equal to rounding
    rng = np.random.default_rng(0)
    b, s = 4, 24
    seg = np.ones((b, s), np.int32)
    seg[:, 15:] = 2  # two documents per row; the loss and the balance statistics respect them
    seg[3, 20:] = 0  # and a padded tail
    rows = np.stack([rng.integers(0, n, (b, s, cfg.engram.n_columns)) for n in cfg.engram.num_embeddings], 2)
    full = {"tokens": rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32), "segment_ids": seg,
            "engram_rows": rows.astype(np.int32)}
    mesh = build_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
    out = {}
    for a in (1, 2):
        state, step, _ = init_state(cfg, ocfg, mesh, seed=0)
        start = jax.device_get(state.params)  # the step donates its input
        batch = {k: v.reshape(a, b // a, *v.shape[1:]) for k, v in full.items()}
        new, metrics = step(state, batch)
        out[a] = jax.device_get((new, metrics))
    (one, m1), (two, m2) = out[1], out[2]
    assert abs(m1["ce"] - m2["ce"]) < 1e-6 * abs(m1["ce"]), (m1, m2)
    assert abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-5 * m1["grad_norm"], (m1, m2)
    assert m1["tokens"] == m2["tokens"]
    moved = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
                zip(jax.tree.leaves(one.params), jax.tree.leaves(start), strict=True))
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
               zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True))
    assert moved > 1e-4 and diff < 1e-3 * moved, (moved, diff)
    # the router-bias rule sees the same loads however the batch is cut
    for x, y in zip(jax.tree.leaves(one.biases), jax.tree.leaves(two.biases), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
