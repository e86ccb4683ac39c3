"""The ``posttrain:`` section is strict like the rest of TrainConfig, and configs/qat_tiny.yaml parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsv41_jax.config import CacheQuant, ConfigError
from dsv41_jax.train.config import load

QAT = Path(__file__).resolve().parents[2] / "configs" / "qat_tiny.yaml"


def test_qat_tiny_parses():
    cfg = load(QAT, ["posttrain.replay.prob=0.25", "model.attention.cache_quant.index=false"])
    p = cfg.posttrain
    assert p.init_from == "runs/pretrain_tiny" and p.sft.paths == ("runs/sft/train.jsonl",)
    assert (p.replay.prob, p.replay.ced, p.replay.cut, p.lm_weight) == (0.25, True, None, 0.25)
    assert p.sft.assistant_prefix == "\n\nAssistant:"
    assert p.distill.weight == 10.0
    assert p.drafter.train and p.drafter.init_from == ""  # the drafter is kept in step where init_from has one
    assert cfg.model.attention.cache_quant == CacheQuant(main_kv=True, index=False, swa=True)
    assert load(QAT.parent / "pretrain_tiny.yaml").posttrain is None


@pytest.mark.parametrize("posttrain, match", [
    ({"init_from": "x", "sft": {"paths": ["a"]}, "replay": {"probability": 0.5}}, r"posttrain\.replay\.probability"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "lr": 1.0}, r"posttrain\.lr"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "replay": {"prob": 1.5}}, r"posttrain\.replay\.prob"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "replay": {"granularity": 0}}, r"posttrain\.replay\.granularity"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "replay": {"cut": "late"}}, r"posttrain\.replay\.cut"),
    ({"init_from": "x"}, r"posttrain\.sft\.paths"),
    ({"sft": {"paths": ["a"]}}, r"posttrain\.init_from"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "lm_weight": -0.1}, r"posttrain\.lm_weight"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "distill": {"weight": -1.0}}, r"posttrain\.distill\.weight"),
    ({"init_from": "x", "sft": {"paths": ["a"]}, "distill": {"temperature": 2.0}}, r"posttrain\.distill\.temperature"),
    ({"init_from": "x", "lm_weight": 1.0, "distill": {"weight": 1.0}}, r"posttrain\.distill\.weight"),
    ({"init_from": "x", "lm_weight": 1.0, "drafter": {"anchors": 0}}, r"posttrain\.drafter\.anchors"),
    ({"init_from": "x", "lm_weight": 1.0, "drafter": {"position_decay": 1.5}}, r"posttrain\.drafter\.position_decay"),
])
def test_rejects_with_key_and_file(tmp_path, posttrain, match):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "posttrain": posttrain}))
    with pytest.raises(ConfigError, match=match) as err:
        load(path)
    assert str(path) in str(err.value)
