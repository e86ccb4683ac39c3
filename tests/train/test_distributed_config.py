"""The ``distributed:`` section and its environment fallbacks: config first, then DSV41_*, then JAX_*;
nothing set means one process; a half-set configuration or a bad variable is an error that names it."""

from __future__ import annotations

import pytest

from dsv41_jax.config import ConfigError
from dsv41_jax.train import distributed
from dsv41_jax.train.config import DistributedConfig


def test_config_then_ours_then_jax():
    env = {"DSV41_COORDINATOR": "a:1", "JAX_COORDINATOR_ADDRESS": "b:2", "JAX_NUM_PROCESSES": "4",
           "DSV41_PROCESS_ID": "3", "JAX_PROCESS_ID": "1"}
    assert distributed.resolve(DistributedConfig(), env) == {"coordinator_address": "a:1", "num_processes": 4,
                                                             "process_id": 3}
    cfg = DistributedConfig(coordinator_address="c:3", process_id=0)
    assert distributed.resolve(cfg, env) == {"coordinator_address": "c:3", "num_processes": 4, "process_id": 0}
    assert distributed.resolve(DistributedConfig(), {}) == dict.fromkeys(distributed.ENV)


def test_bad_variable_is_named():
    with pytest.raises(ConfigError, match="DSV41_NUM_PROCESSES='two'"):
        distributed.resolve(DistributedConfig(), {"DSV41_NUM_PROCESSES": "two"})


def test_single_process_needs_nothing(monkeypatch):
    for names in distributed.ENV.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    assert distributed.initialize(DistributedConfig()) is False


def test_half_set_is_an_error(monkeypatch):
    for names in distributed.ENV.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="num_processes, process_id not set"):
        distributed.initialize(DistributedConfig(coordinator_address="localhost:1234"))
