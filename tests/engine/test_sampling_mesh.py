"""Sampling on a mesh: the golden checkpoint's weights sharded (experts over ``expert``), the two sequences
split over the expert axis and MoE layers expert-parallel; greedy generation still reproduces the reference's
tokens. Runs in an 8-fake-device child (``mesh_child.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_greedy_generation_on_an_expert_parallel_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("mesh_child.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, out.stdout
    for r in rows:
        assert r["tokens"] == r["want"], r
        assert r["expert_shards"] == r["mesh"][2], r  # each device holds its own slice of the experts
        assert "expert" in r["cache_spec"], r  # the sequences really were split over the expert axis
