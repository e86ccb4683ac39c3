"""TrainConfig is strict: unknown keys, wrong types and impossible meshes are errors naming key and file;
every run config in configs/ parses; dotted overrides reach nested keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsv41_jax.config import ConfigError
from dsv41_jax.train.config import AUTO, MeshConfig, load

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "configs" / "pretrain_tiny.yaml"


def _write(tmp_path, data) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_pretrain_tiny_parses():
    cfg = load(PRETRAIN)
    assert cfg.model.dim == 64 and cfg.model.dtype == "float32"
    assert cfg.mesh.data == AUTO and cfg.data.source == "embedded" and cfg.data.tokenizer == "train"
    assert cfg.optim.seq_balance_alpha == 1e-4
    assert cfg.optim.indexer_kl_weight > 0 and cfg.optim.indexer_kl_over == "dense"  # the indexer trains


def test_overrides_reach_nested_keys():
    cfg = load(PRETRAIN, ["optim.lr=1.0e-3", "model.moe.n_routed_experts=16", "steps=7", "mesh.fsdp=2",
                          "data.paths=[a.txt]", "data.source=text"])
    assert (cfg.optim.lr, cfg.model.moe.n_routed_experts, cfg.steps, cfg.mesh.fsdp) == (1e-3, 16, 7, 2)
    assert cfg.data.paths == ("a.txt",)


@pytest.mark.parametrize("data, match", [
    ({"model": {"preset": "tiny"}, "optimizer": {}}, "unknown key.*optimizer"),
    ({"model": {"preset": "tiny"}, "data": {"seq_length": 3}}, r"data\.seq_length"),
    ({"model": {"preset": "tiny", "dimm": 3}}, r"unknown key\(s\) model\.dimm \(did you mean model\.dim\?\)"),
    ({"model": {"preset": "tiny"}, "optim": {"lrr": 1.0}}, r"unknown key\(s\) optim\.lrr \(did you mean optim\.lr\?\)"),
    ({"model": {"preset": "tiny", "moe": {"n_routed_expert": 3}}}, r"model\.moe\.n_routed_expert \(did you mean "
     r"model\.moe\.n_routed_experts\?\)"),
    ({"model": {"preset": "tiny"}, "stpes": 3}, r"unknown key\(s\) stpes \(did you mean steps\?\)"),
    ({"model": {"preset": "tiny"}, "optim": {"lr": "fast"}}, "key 'optim.lr' must be a number"),
    ({"model": {"preset": "tiny", "attention": {"window_size": "8"}}}, "key 'model.attention.window_size' must be an "
     "integer"),
    ({"model": {"preset": "tiny", "attention": {"window_size": 0}}}, "model: attention.window_size must be ≥ 1, "
     "got 0"),
    ({"model": {"preset": "tiny"}, "optim": {"lr_floor": 1.0}}, "optim: need 0 ≤ lr_floor ≤ lr"),
    ({"model": {"preset": "tiny"}, "nonfinite": {"action": "ignore"}}, "key 'nonfinite.action' must be stop or skip"),
    ({"model": {"preset": "tiny"}, "steps": 1.5}, "'steps' must be an integer"),
    ({"model": {"preset": "tiny"}, "mesh": {"data": "auto", "fsdp": "auto"}}, "at most one axis"),
    ({"model": {"preset": "tiny"}, "mesh": {"expert": 0}}, r"mesh\.expert"),
    ({"model": {"preset": "tiny"}, "mesh": {"data": 3}}, r"data\.batch_size.*divisible"),
    ({"model": {"preset": "tiny"}, "data": {"source": "xml"}}, r"data\.source"),
    ({"model": {"preset": "tiny"}, "data": {"prefetch": -1}}, r"data\.read_threads.*data\.prefetch"),
    ({"model": {"preset": "tiny"}, "distributed": {"num_processes": 2, "process_id": 2}}, r"distributed\.process_id"),
    ({"model": {"preset": "tiny"}, "distributed": {"coordinator": "h:1"}}, r"distributed\.coordinator"),
    ({"model": {"preset": "tiny"}, "remat": "full"}, "remat.*none, block or dots"),
    ({"model": {"preset": "tiny"}, "optim": {"indexer_kl_over": "all"}}, "indexer_kl_over"),
    ({"model": {"dim": 8}}, r"model\.preset"),
    ({"model": {"preset": "tiny"}, "data": {"max_documents": 0}}, r"data\.max_documents"),
    ({"model": {"preset": "tiny"}, "validation": {"documents": 4, "every": 0}}, r"validation\.every ≥ 1"),
    ({"model": {"preset": "tiny"}, "data": {"packing": "first_fit"}}, r"key 'data\.packing' must be one of concat, "
     "best_fit"),
    ({"model": {"preset": "tiny"}, "optim": {"warmup_steps": 2, "constant_until": 5, "decay_until": 8,
                                             "total_steps": 10}, "steps": 11},
     r"key 'steps' \(11\) is beyond the learning-rate schedule's key 'optim\.total_steps' \(10\)"),
    ({"model": {"preset": "tiny"}, "logging": {"tensorboard": "s3://b/tb"}},  # not a local directory named 's3:'
     r"key 'logging\.tensorboard' is a URI \('s3://b/tb'\): metrics are written to local files"),
    ({"model": {"preset": "tiny"}, "logging": {"jsonl": "gs://b/m.jsonl"}}, r"key 'logging\.jsonl' is a URI"),
])
def test_rejects_with_key_and_file(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=match) as err:
        load(path)
    assert str(path) in str(err.value)


def test_floats_without_a_point_and_no_document_cap():
    # YAML 1.1 would read 1e-3 as a string; a run config reads it as 1.2 does, in the file and in an override
    cfg = load(PRETRAIN, ["optim.lr=1e-3", "optim.lr_floor=2E-5"])
    assert (cfg.optim.lr, cfg.optim.lr_floor) == (1e-3, 2e-5) and cfg.optim.seq_balance_alpha == 1e-4
    assert cfg.data.max_documents is None and load(PRETRAIN, ["data.max_documents=30"]).data.max_documents == 30
    assert load(PRETRAIN, ["steps=300"]).steps == 300  # the schedule's own length is allowed


def test_bad_override_names_the_override():
    with pytest.raises(ConfigError, match="optim.lrr"):
        load(PRETRAIN, ["optim.lrr=1.0"])
    with pytest.raises(ConfigError, match="key=value"):
        load(PRETRAIN, ["steps"])


def test_mesh_shapes():
    assert MeshConfig().shape(8) == (8, 1, 1, 1)
    assert MeshConfig(data=AUTO, fsdp=2, expert=2).shape(8) == (2, 2, 2, 1)
    assert MeshConfig(data=1, fsdp=2, expert=2, tensor=2).shape(8) == (1, 2, 2, 2)
    with pytest.raises(ConfigError, match="needs 4 devices but 8"):
        MeshConfig(data=1, fsdp=2, expert=2, tensor=1).shape(8, "run.yaml")
    with pytest.raises(ConfigError, match="does not divide"):
        MeshConfig(data=AUTO, fsdp=3).shape(8, "run.yaml")
