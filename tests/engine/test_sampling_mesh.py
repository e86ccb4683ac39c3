"""Sampling and serving on a mesh, in one 8-fake-device child (``mesh_child.py``).

``dsv41 serve --mesh expert=8`` of the golden checkpoint, restored straight into its shards (each device holds
its own expert), its batch rows split over the expert axis and MoE layers expert-parallel: greedy completions
through the openai client reproduce the reference's tokens, which one device gives too, and a conversation
resumed from the host tier (global KV and SWA rings written back into the sharded cache) gives the tokens of a
cold run. Speculative decoding too: the drafter sharded by the same table, the sequences and the drafter's
rings split over ``data`` × ``expert``; greedy speculative output equals plain greedy decoding on one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv41_jax.testing import run_on_fake_cpus

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def rows():
    return run_on_fake_cpus(Path(__file__).with_name("mesh_child.py"), fast_compile=True)


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_greedy_generation_served_on_an_expert_parallel_mesh(rows):
    (r,) = [r for r in rows if r.get("served")]
    assert r["mesh"] == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}
    assert r["tokens"] == r["want"], r
    assert r["expert_shards"] == 8, r  # each device restored only its own expert
    assert "expert" in r["cache_spec"], r  # the sequences really were split over the expert axis
    assert r["host_hits"] == 1 and r["hit"] == r["cold"], r


def test_greedy_speculative_on_a_mesh_equals_one_device(rows):
    (r,) = [r for r in rows if r.get("speculative")]
    assert r["tokens"] == r["want"], r
    steps, drafted, accepted = (r["stats"][k] for k in ("steps", "drafted", "accepted"))
    assert max(steps) < 10 and accepted[0] < drafted[0], r  # drafts accepted (fewer steps than tokens) and rejected
    assert r["draft_rings_split"], r  # the drafter's rings split over data × expert with the sequences
    assert r["drafter_expert_shards"] == 4, r  # the drafter's 4 experts, one per device of the expert axis
