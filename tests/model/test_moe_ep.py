"""Expert-parallel MoE (``routed_experts_ep``) equals the single-device grouped matmul: forward and gradient,
on meshes that split the tokens over the expert axis (all-gather + reduce-scatter) and one that cannot
(batch 1: all-reduce). Runs in an 8-fake-device child (``ep_child.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_expert_parallel_moe_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("ep_child.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4, out.stdout
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
