"""Sampling on a mesh: the golden checkpoint's weights sharded (experts over ``expert``), the two sequences
split over the expert axis and MoE layers expert-parallel; greedy generation still reproduces the reference's
tokens. Speculative decoding too: the drafter sharded by the same table, the sequences and the drafter's rings
split over ``data`` × ``expert``; greedy speculative output equals plain greedy decoding on one device. Both run
in one 8-fake-device child (``mesh_child.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv41_jax.testing import run_on_fake_cpus


@pytest.fixture(scope="module")
def rows():
    return run_on_fake_cpus(Path(__file__).with_name("mesh_child.py"))


def test_greedy_generation_on_an_expert_parallel_mesh(rows):
    for r in [r for r in rows if not r.get("speculative")]:
        assert r["tokens"] == r["want"], r
        assert r["expert_shards"] == r["mesh"][2], r  # each device holds its own slice of the experts
        assert "expert" in r["cache_spec"], r  # the sequences really were split over the expert axis


def test_greedy_speculative_on_a_mesh_equals_one_device(rows):
    (r,) = [r for r in rows if r.get("speculative")]
    assert r["tokens"] == r["want"], r
    steps, drafted, accepted = (r["stats"][k] for k in ("steps", "drafted", "accepted"))
    assert max(steps) < 10 and accepted[0] < drafted[0], r  # drafts accepted (fewer steps than tokens) and rejected
    assert r["draft_rings_split"], r  # the drafter's rings split over data × expert with the sequences
    assert r["drafter_expert_shards"] == 4, r  # the drafter's 4 experts, one per device of the expert axis
