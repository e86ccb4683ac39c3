"""On 8 fake CPU devices the sharded optimizer equals the unsharded one (spec model §9.3: Sinkhorn norms are
global over row and feature shards), and its state shards like the parameters.

The 8-device run is ``sharded_child.py`` in a child process (fixture ``optim_eight_devices`` in conftest.py).
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("layout", ["rows/8", "rows/4 x features/2"])
def test_sharded_sinkhorn_equals_unsharded(optim_eight_devices, layout):
    r = optim_eight_devices["table " + layout]
    assert r["all_reduce"]  # the norms really were combined across devices
    assert r["diff"] < 1e-5, r  # entries of Δ are O(1): fp32 reduction-order noise only


def test_sharded_optimizer_equals_unsharded(optim_eight_devices):
    for name, r in optim_eight_devices["params"].items():
        assert r["same_sharding"], name
        assert r["scale"] > 1e-3, (name, r)  # the two steps moved the weights ...
        assert r["diff"] < 2e-7, (name, r)  # ... and both runs agree to a few fp32 ulps of weights ≈ 0.1


def test_optimizer_state_shards_like_its_parameters(optim_eight_devices):
    s = optim_eight_devices["state"]
    assert not s["mismatched"], s["mismatched"]
    assert s["buffers"] == 9 + 2 * 2  # one buffer each for 9 Muon/Sinkhorn params, two for 2 AdamW params
