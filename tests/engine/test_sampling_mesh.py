"""Sampling on a mesh: the golden checkpoint's weights sharded (experts over ``expert``), the two sequences
split over the expert axis and MoE layers expert-parallel; greedy generation still reproduces the reference's
tokens. Runs in an 8-fake-device child (``mesh_child.py``)."""

from __future__ import annotations

from pathlib import Path

from dsv41_jax.testing import run_on_fake_cpus


def test_greedy_generation_on_an_expert_parallel_mesh():
    rows = run_on_fake_cpus(Path(__file__).with_name("mesh_child.py"))
    for r in rows:
        assert r["tokens"] == r["want"], r
        assert r["expert_shards"] == r["mesh"][2], r  # each device holds its own slice of the experts
        assert "expert" in r["cache_spec"], r  # the sequences really were split over the expert axis
