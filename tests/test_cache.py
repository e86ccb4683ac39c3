"""The packed cache's byte ledger, computed from the cache arrays (spec attention §7.5)."""

from __future__ import annotations

import jax
import numpy as np

from dsv41_jax import cache as C
from dsv41_jax import config


def test_release_ledger():
    led = C.ledger(config.v41_flash())
    assert led["global_kv_bytes_per_token"] == 890
    ratio2 = sum(led[f"global_kv_bytes_per_token_layer_{s}"] for s in (2, 8, 14))
    assert ratio2 == 534 and led["global_kv_bytes_per_token_layer_20"] == 356
    assert led["swa_bytes_per_sequence"] == 40 * 128 * 528 == 2_703_360


def test_cache_shapes_follow_max_seq_len_not_tokens():
    cfg = config.tiny()
    cache = jax.eval_shape(lambda: C.init_cache(cfg, 3, 256))
    assert [s.kv_codes.shape for s in cache.sources] == [(3, 128, 32), (3, 128, 32), (3, 256, 32)]
    assert [s.carry_c.shape for s in cache.sources] == [(3, 64), (3, 64), (3, 0)]
    assert all(r.values.shape == (3, 8, 64) and r.exps.shape == (3, 8, 2) for r in cache.rings)


def test_ring_positions():
    pos = np.asarray(C.ring_positions(np.array([0, 3, 8, 21]), 8))
    assert (pos[0] == -1).all()
    np.testing.assert_array_equal(pos[1], [0, 1, 2, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(pos[2], np.arange(8))
    np.testing.assert_array_equal(pos[3], [16, 17, 18, 19, 20, 13, 14, 15])
