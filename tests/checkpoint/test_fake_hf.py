"""``dsv41 make-fake-hf``: the exact release layout for any config, realistic magnitudes, a usable tokenizer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax.checkpoint import hf
from dsv41_jax.checkpoint.fake_hf import byte_level_tokenizer, write_fake_hf, write_tokenizer
from dsv41_jax.checkpoint.inventory import expected_inventory
from dsv41_jax.checkpoint.safetensors import ShardedCheckpoint
from dsv41_jax.cli import main
from dsv41_jax.engram_hash import build_token_map


@pytest.fixture(scope="module")
def cli_fake(tmp_path_factory):
    out = tmp_path_factory.mktemp("fake") / "tiny"
    assert main(["make-fake-hf", "--config", "tiny", "--out", str(out), "--seed", "5", "--shard-mb", "0.5"]) == 0
    return out


def test_layout_is_the_golden_release_format(cli_fake, golden_dir):
    fake, gold = ShardedCheckpoint(cli_fake), ShardedCheckpoint(golden_dir / "tiny_hf")
    fake.validate()
    assert sorted(fake.keys()) == sorted(gold.keys())
    assert {n: fake.info(n) for n in fake.keys()} == {n: gold.info(n) for n in gold.keys()}  # dtype, shape, bytes
    index = json.loads((cli_fake / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(fake.info(n).nbytes for n in fake.keys()) == 3_208_028
    assert (cli_fake / "config.json").read_text() == C.to_hf_json(C.tiny())
    assert (cli_fake / "config.json").read_bytes() == (golden_dir / "tiny_hf" / "config.json").read_bytes()
    assert len(fake.shards()) > 3


def test_engram_tables_sit_alone_in_the_last_shards(cli_fake):
    # as in the release (spec model §2.1): one shard per table, each holding its weight and row scales
    ckpt = ShardedCheckpoint(cli_fake)
    last = ckpt.shards()[-2:]
    for shard, layer in zip(last, C.tiny().engram.layer_ids, strict=True):
        assert sorted(n for n in ckpt.keys() if ckpt.shard_of(n) == shard) == \
            [f"layers.{layer}.engram.embed.scale", f"layers.{layer}.engram.embed.weight"]


def test_magnitudes_are_realistic(cli_fake):
    # spec model §2.9: embedding RMS ≈ 0.12, RMSNorm weight means per family
    p = hf.load_hf_params(cli_fake, include=lambda n: "norm" in n or n in ("embed.weight", "layers.0.attn.wq_a.weight"))
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    assert rms(p["embed.weight"]) == pytest.approx(0.12, rel=0.05)
    for family, mean in (("attn_norm", 0.025), ("ffn_norm", 0.2), ("q_norm", 0.97), ("kv_norm", 0.4),
                         ("compressor.norm", 0.6), ("indexer.k_norm", 0.5)):
        values = np.concatenate([v for n, v in p.items() if n.endswith(f"{family}.weight")])
        assert values.mean() == pytest.approx(mean, rel=0.05), family
    assert rms(p["layers.0.attn.wq_a.weight"]) == pytest.approx(64**-0.5, rel=0.1)  # fan-in


def test_seed_determines_every_byte(tmp_path, cli_fake):
    write_fake_hf(C.tiny(), tmp_path / "again", seed=5, shard_bytes=1 << 19)
    write_fake_hf(C.tiny(), tmp_path / "other", seed=6, shard_bytes=1 << 19)
    shards = sorted(p.name for p in cli_fake.glob("*.safetensors"))
    assert all((tmp_path / "again" / s).read_bytes() == (cli_fake / s).read_bytes() for s in shards)
    assert (tmp_path / "other" / shards[0]).read_bytes() != (cli_fake / shards[0]).read_bytes()


def test_tokenizer_map_has_the_configured_size(cli_fake):
    assert np.unique(build_token_map(cli_fake / "tokenizer.json")).size == C.tiny().engram.compressed_vocab_size


def test_other_vocab_gets_a_byte_level_tokenizer(tmp_path):
    cfg = C.tiny().replace(vocab_size=1024)
    written = write_tokenizer(cfg, tmp_path)
    token_map = build_token_map(tmp_path / "tokenizer.json")
    assert token_map.size == 1024 and token_map[:3].tolist() == [0, 1, 2]  # BOS, EOS, PAD first (spec §6.2)
    # the compressed vocab is set to what the tokenizer really has, so the Engram hash stays consistent
    assert written.engram.compressed_vocab_size == np.unique(token_map).size != cfg.engram.compressed_vocab_size
    assert written.replace(engram=cfg.engram) == cfg


def test_byte_level_tokenizer_round_trips_text():
    tok = byte_level_tokenizer(600)
    assert tok.get_vocab_size(with_added_tokens=True) == 600
    text = "hello world, ünïcode ✓"
    assert tok.decode(tok.encode(text).ids) == text
    with pytest.raises(ValueError, match="below the 259 ids"):
        byte_level_tokenizer(200)


def test_params_must_have_the_release_shape(tmp_path, tiny_params):
    bad = dict(tiny_params) | {"embed.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match=r"params\['embed.weight'\] has shape \(3, 3\)"):
        write_fake_hf(C.tiny(), tmp_path, params=bad)


def test_any_config_gets_its_inventory(tmp_path):
    # a config unlike the golden's: wider model, more experts, one DSpark stage (first and last at once)
    tiny = C.tiny()
    ratios = tiny.attention.compress_ratios[:13]
    cfg = tiny.replace(dim=96, vocab_size=700,
                       dspark=C.DSparkConfig(n_layers=1, noise_token_id=500, target_layer_ids=(11,), markov_rank=32,
                                             n_routed_experts=2, n_activated_experts=1),
                       attention=dataclasses.replace(tiny.attention, compress_ratios=ratios))
    written = write_fake_hf(cfg, tmp_path, shard_bytes=1 << 20)
    ckpt = ShardedCheckpoint(tmp_path)
    assert {n: (ckpt.info(n).dtype, ckpt.info(n).shape) for n in ckpt.keys()} == \
        {t.name: (t.dtype, t.shape) for t in expected_inventory(written)}
    assert C.from_hf(tmp_path) == written
