"""``OptimConfig``: the spec's numbers as defaults, and a strict loader whose errors name key and file."""

from __future__ import annotations

import dataclasses

import pytest

from dsv41_jax.config import ConfigError
from dsv41_jax.optim import OptimConfig, from_dict, load_yaml

# spec model §9.1–§9.4 and §5.3, number by number
SPEC = {
    "lr": 2.6e-4, "lr_floor": 2.6e-5, "warmup_steps": 2000, "muon_momentum": 0.95, "muon_nesterov": True,
    "muon_rms": 0.18, "weight_decay": 0.1, "ns_coeffs": (3.4445, -4.7750, 2.0315), "ns_steps": 8,
    "ns_tail_coeffs": (2.0, -1.5, 0.5), "ns_tail_steps": 2, "adam_b1": 0.9, "adam_b2": 0.95, "adam_eps": 1e-20,
    "sinkhorn_momentum": 0.95, "sinkhorn_tau": 1e-3, "sinkhorn_iters": 11, "sinkhorn_eps": 1e-20,
    "sinkhorn_gamma": 0.18, "engram_lr_mult": 5.0, "bias_update_speed": 1e-3, "seq_balance_alpha": 1e-4,
}


def test_defaults_are_the_spec_numbers():
    cfg = OptimConfig()
    assert {k: getattr(cfg, k) for k in SPEC} == SPEC
    assert len(cfg.ns_schedule) == 10 and cfg.ns_schedule[7] == SPEC["ns_coeffs"]
    assert cfg.ns_schedule[8:] == (SPEC["ns_tail_coeffs"],) * 2


def test_from_dict_round_trip_and_overrides():
    cfg = from_dict({"lr": 1e-3, "ns_coeffs": [3, -4, 2], "warmup_steps": 10})
    assert cfg.lr == 1e-3 and cfg.ns_coeffs == (3.0, -4.0, 2.0) and cfg.warmup_steps == 10
    assert from_dict(dataclasses.asdict(OptimConfig())) == OptimConfig()


@pytest.mark.parametrize("data, pattern", [
    ({"learning_rate": 1e-3}, r"train\.yaml: unknown key\(s\) learning_rate; valid keys here: .*lr"),
    ({"warmup_steps": 2.5}, r"train\.yaml: key 'warmup_steps' must be an integer, got float 2\.5"),
    ({"lr": "1e-3"}, r"train\.yaml: key 'lr' must be a number, got str '1e-3'"),
    ({"muon_nesterov": 1}, r"train\.yaml: key 'muon_nesterov' must be bool"),
    ({"ns_coeffs": [1.0, 2.0]}, r"train\.yaml: 'ns_coeffs' must hold three numbers"),
    ({"constant_until": 10}, r"train\.yaml: need 0 ≤ warmup_steps ≤ constant_until"),
    ({"adam_b2": 1.0}, r"train\.yaml: 'adam_b2' must be in \[0, 1\)"),
    ({1: 2}, r"train\.yaml: optimizer config keys must be strings"),
], ids=["unknown key", "int as float", "number as str", "bool as int", "two coefficients", "schedule order",
        "beta of 1", "non-string key"])
def test_bad_values_name_key_and_file(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(data, source="train.yaml")


def test_load_yaml_section(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("optim:\n  lr: 1.0e-3\n  sinkhorn_iters: 5\n")
    assert load_yaml(path, section="optim") == OptimConfig(lr=1e-3, sinkhorn_iters=5)
    path.write_text("optim:\n  sinkhorn_itres: 5\n")
    with pytest.raises(ConfigError, match=f"{path}: unknown key.*sinkhorn_itres"):
        load_yaml(path, section="optim")
