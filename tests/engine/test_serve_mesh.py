"""``--mesh`` on ``dsv41 score``, ``dsv41 eval-served`` and ``dsv41 sample``: a converted checkpoint restored
straight into its shards on 8 fake CPU devices scores and evaluates as on one device (a child,
``serve_mesh_child.py``); ``sample --mesh`` hands the mesh to the generator, whose sharded decoding
``test_sampling_mesh.py`` checks against the reference's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv41_jax.config import ConfigError
from dsv41_jax.engine.mesh import parse_mesh
from dsv41_jax.testing import run_on_fake_cpus


@pytest.fixture(scope="module")
def child() -> dict:
    (r,) = run_on_fake_cpus(Path(__file__).with_name("serve_mesh_child.py"), fast_compile=True)
    return r


def test_score_on_eight_devices_equals_one(child):
    r = child
    assert r["mesh"] == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}
    assert r["expert_shards"] == 8  # each device restored only its own expert
    assert r["argmax_same"] and r["logits_rel_err"] <= 1e-6, r  # fp32: only the summation order may differ


def test_eval_served_on_eight_devices_equals_one(child):
    # data=2 x expert=4: the engine's cache split over the batch, experts over 4 devices; every table entry as
    # on one device (fp32; sums ordered differently only), every next-token agreement identical
    one, eight = child["eval_served"]["one"], child["eval_served"]["eight"]
    assert [(r["setting"], r["boundary"]) for r in one] == [("served", "cold"), ("served", "12")]
    assert [(r["setting"], r["boundary"], r["tokens"], r["agree"]) for r in eight] == \
        [(r["setting"], r["boundary"], r["tokens"], r["agree"]) for r in one]
    assert one[1]["kl"] > one[0]["kl"] > 1e-3  # the served path is not the exact one; a hit moves it further
    for a, b in zip(one, eight, strict=True):
        for key in ("nll_exact", "nll_served", "dnll", "dnll_max", "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)


def test_mesh_flag():
    assert parse_mesh("expert=4,data=2", n_devices=8) == (2, 1, 4, 1)
    assert parse_mesh("auto", n_experts=384, n_devices=8) == (1, 1, 8, 1)
    assert parse_mesh("auto", n_experts=6, n_devices=4) == (4, 1, 1, 1)  # experts do not divide: data
    assert parse_mesh(None) is None
    with pytest.raises(ConfigError, match=r"--mesh 'expert=4': 4 devices, but 8 are present"):
        parse_mesh("expert=4", n_devices=8)
    with pytest.raises(ConfigError, match="expected auto or AXIS=SIZE"):
        parse_mesh("experts=8", n_devices=8)


def test_sample_hands_the_mesh_to_the_generator(golden_dir, monkeypatch):
    import jax

    from dsv41_jax import sample as sample_mod
    from dsv41_jax.cli import main

    seen = []

    class Recorder:
        def __init__(self, *args, mesh=None, **kwargs):  # (the drafter, when one is given)
            seen.append(mesh)

        def generate(self, batch, **kwargs):
            return [[] for _ in batch]

    monkeypatch.setattr(sample_mod, "Generator", Recorder)
    assert main(["sample", "--hf-dir", str(golden_dir / "tiny_hf"), "--ids", "0,5", "--mesh", "auto"]) == 0
    assert isinstance(seen[0], jax.sharding.Mesh) and seen[0].shape["expert"] == jax.device_count()
