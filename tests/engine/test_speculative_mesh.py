"""Speculative decoding on a mesh: the weights and the drafter sharded by the sharding table (experts over
``expert``), the sequences and the drafter's rings split over ``data`` × ``expert``; greedy speculative output
equals plain greedy decoding on one device. Runs in an 8-fake-device child (``speculative_mesh_child.py``)."""

from __future__ import annotations

from pathlib import Path

from dsv41_jax.testing import run_on_fake_cpus


def test_greedy_speculative_on_a_mesh_equals_one_device():
    (r,) = run_on_fake_cpus(Path(__file__).with_name("speculative_mesh_child.py"))
    assert r["tokens"] == r["want"], r
    steps, drafted, accepted = (r["stats"][k] for k in ("steps", "drafted", "accepted"))
    assert max(steps) < 10 and accepted[0] < drafted[0], r  # drafts accepted (fewer steps than tokens) and rejected
    assert r["draft_rings_split"], r  # the drafter's rings split over data × expert with the sequences
    assert r["drafter_expert_shards"] == 4, r  # the drafter's 4 experts, one per device of the expert axis
