"""On 8 fake CPU devices (data × fsdp × expert = 2 × 2 × 2, expert-parallel MoE, per-device top-k) one
post-training step equals the single-device step, as pre-training's does (``tests/train``). Run in
``sharded_child.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv41_jax.testing import run_on_fake_cpus


@pytest.mark.slow  # two compiles of a 2-layer post-training step in an 8-device child
def test_posttrain_step_on_a_mesh_equals_one_device():
    (r,) = run_on_fake_cpus(Path(__file__).with_name("sharded_child.py"), fast_compile=True)
    one, eight = r["single"], r["sharded"]
    assert one["hit_frac"] == eight["hit_frac"] and 0 < one["hit_frac"] < 1  # the same replay draws
    assert one["distill_kl"] > 0 and one["indexer_kl"] > 0
    for key in ("loss", "sft_ce", "distill_kl", "indexer_kl", "indexer_agreement", "grad_norm"):
        assert eight[key] == pytest.approx(one[key], rel=1e-5), (key, one[key], eight[key])
    assert r["params_rel"] < 1e-3, r
