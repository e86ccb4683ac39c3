"""Expert-parallel MoE (``routed_experts_ep``) equals the single-device grouped matmul: forward and gradient,
on meshes that split the tokens over the expert axis (all-gather + reduce-scatter) and one that cannot
(batch 1: all-reduce); and decode-shaped forwards of MXFP4 experts on the gathered path, each device
gathering only its own picked experts, and on the dense one, each device running its own experts, equal to
the single-device grouped matmul. Runs in an 8-fake-device
child (``ep_child.py``)."""

from __future__ import annotations

from pathlib import Path

from dsv41_jax.testing import run_on_fake_cpus


def test_expert_parallel_moe_equals_single_device():
    rows = run_on_fake_cpus(Path(__file__).with_name("ep_child.py"), fast_compile=True)
    decode = [r for r in rows if "decode" in r]
    rows = [r for r in rows if "decode" not in r]
    assert len(rows) == 4 and len(decode) == 4, rows + decode
    for r in decode:  # fp32: only the order of the sum over a token's experts differs
        assert r["err"] <= 1e-6 * r["scale"] and r["scale"] > 0.1, r
        # batch 1 cannot split over 8 devices (all-reduce); batch 2 over 2 can (all-gather, reduce-scatter)
        assert ("all-gather" in r["collectives"]) == (r["batch"] > 1) and r["collectives"], r
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
