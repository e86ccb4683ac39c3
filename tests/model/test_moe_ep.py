"""Expert-parallel MoE (``routed_experts_ep``) equals the single-device grouped matmul: forward and gradient,
on meshes that split the tokens over the expert axis (all-gather + reduce-scatter) and one that cannot
(batch 1: all-reduce). Runs in an 8-fake-device child (``ep_child.py``)."""

from __future__ import annotations

from pathlib import Path

from dsv41_jax.testing import run_on_fake_cpus


def test_expert_parallel_moe_equals_single_device():
    rows = run_on_fake_cpus(Path(__file__).with_name("ep_child.py"))
    assert len(rows) == 4, rows
    for r in rows:
        v1, v2 = r["value"]
        assert abs(v1 - v2) <= 2e-6 * abs(v1), r
        assert r["grad_x"] <= 1e-6 * r["grad_scale"] + 1e-6, r
        assert r["grad_params"] <= 1e-5, r
        split = r["batch"] * 6 % (r["mesh"][0] * r["mesh"][1] * r["mesh"][2]) == 0
        if split:  # tokens split over `expert`: gathered in, partial outputs scattered back
            assert {"all-gather", "reduce-scatter"} <= set(r["collectives"]), r
        else:
            assert "reduce-scatter" not in r["collectives"] and "all-reduce" in r["collectives"], r
