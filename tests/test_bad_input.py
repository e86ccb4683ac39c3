"""Bad configs and data sources are one line naming the file and the full dotted key, exit code 2, before
anything is built or compiled (also under ``dsv41 train --preflight``): model values out of range or
inconsistent, YAML files that are empty, hold several documents or give a key twice, empty corpora and binary
files given as text."""

from __future__ import annotations

import json

import pytest

from dsv41_jax import config as C
from dsv41_jax.cli import main
from dsv41_jax.config import ConfigError
from dsv41_jax.data.corpus import open_documents


@pytest.mark.parametrize("change, message", [
    ({"dim": 0}, "dim must be ≥ 1, got 0"),
    ({"norm_eps": 0.0}, "norm_eps must be > 0, got 0.0"),
    ({"attention": {"window_size": 0}}, "attention.window_size must be ≥ 1, got 0"),
    ({"attention": {"index_topk": 0}}, "attention.index_topk must be ≥ 1, got 0"),
    ({"attention": {"q_lora_rank": 0}}, "attention.q_lora_rank must be ≥ 1, got 0"),
    ({"attention": {"rope_factor": 0.5}}, "attention.rope_factor must be ≥ 1"),
    ({"attention": {"beta_fast": 1.0}}, "attention.beta_fast (1.0) must exceed beta_slow (1.0)"),
    ({"attention": {"rope_theta": float("nan")}}, "attention.rope_theta must be > 0, got nan"),
    ({"moe": {"route_scale": 0.0}}, "moe.route_scale must be > 0, got 0.0"),
    ({"moe": {"routed_path": "sparse"}},
     "moe.routed_path must be one of 'auto', 'gather', 'dense', 'grouped', got 'sparse'"),
    ({"mhc": {"hc_mult": 0}}, "mhc.hc_mult must be ≥ 1, got 0"),
    ({"mhc": {"hc_sinkhorn_iters": 0}}, "mhc.hc_sinkhorn_iters must be ≥ 1, got 0"),
    ({"engram": {"n_heads": 3}}, "engram.num_embeddings [434, 606] must be the rows the hash addresses, [721, 1115]"),
    ({"engram": {"pad_id": 512}}, "engram.pad_id 512 is not a token id of the vocabulary [0, 512)"),
    ({"bos_token_id": -1}, "bos_token_id -1 is not a token id of the vocabulary [0, 512)"),
    ({"vocab_size": 400}, "dspark.noise_token_id 500 is not a token id of the vocabulary [0, 400)"),
    ({"dspark": {"n_activated_experts": 5}}, "dspark.n_activated_experts (5) must be ≤ dspark.n_routed_experts (4)"),
    ({"dspark": {"block_size": 0}}, "dspark.block_size must be ≥ 1, got 0"),
    ({"vision": {"n_heads": 3}}, "vision.dim 64 must be divisible by vision.n_heads 3"),
])
def test_model_values_out_of_range(change, message):
    with pytest.raises(ConfigError) as err:
        C.from_dict({"preset": "tiny", **change}, "f.yaml")
    assert str(err.value) == f"f.yaml: {message}" or str(err.value).startswith(f"f.yaml: {message}"), str(err.value)


def test_every_preset_passes():
    for make in C.PRESETS.values():
        make()


def _train_yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_preflight_checks_the_model_with_the_full_key(tmp_path, capsys):
    path = _train_yaml(tmp_path, "model:\n  preset: tiny\n")
    line = _one_line(capsys, ["train", "--config", str(path), "model.attention.index_topk=0", "--preflight"])
    assert line.endswith("model: attention.index_topk must be ≥ 1, got 0"), line
    line = _one_line(capsys, ["train", "--config", str(path), "optim.lrr=0.1", "--preflight"])
    assert "unknown key(s) optim.lrr (did you mean optim.lr?)" in line, line


@pytest.mark.parametrize("text, message", [
    ("", "the file is empty (or only comments); a config needs its keys"),
    ("# only a comment\n", "the file is empty"),
    ("model:\n  preset: tiny\n---\nsteps: 3\n", "holds 2 YAML documents (separated by '---')"),
    ("model:\n  preset: tiny\nsteps: 3\nsteps: 4\n", "line 4: key 'steps' is given twice (also on line 3)"),
    ("model:\n  preset: tiny\n  moe:\n    gate_temp: 1.0\n    gate_temp: 2.0\n", "line 5: key 'gate_temp' is given "
     "twice (also on line 4)"),
    ("model:\n  preset: tiny\n  dim: [1, 2\n", "not valid YAML at line 4, column 1: expected ',' or ']'"),
])
def test_yaml_files_that_are_not_one_config(tmp_path, capsys, text, message):
    path = _train_yaml(tmp_path, text)
    line = _one_line(capsys, ["train", "--config", str(path), "--preflight"])
    assert line.startswith(f"error: {path}: {message}"), line


def test_data_sources_that_hold_nothing_to_train_on(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "latin1.txt").write_bytes("déjà vu, naïve café ".encode("latin-1") * 20)
    (tmp_path / "ok.txt").write_text("def f():\n    return 1\n")
    cases = [
        ("text", "empty.txt", f"data.paths ['{tmp_path}/empty.txt']: the corpus is empty (only empty files); "
                              "nothing to train on"),
        ("jsonl", "blank.jsonl", f"data.paths ['{tmp_path}/blank.jsonl']: the corpus is empty (no line with a "
                                 "non-empty 'text' (data.jsonl_key))"),
        ("text", "binary.txt", f"{tmp_path}/binary.txt: a binary file (it holds NUL bytes), not UTF-8 text"),
        ("text", "latin1.txt", f"{tmp_path}/latin1.txt: 80 of 400 characters are not UTF-8 (the first at byte 1): a "
                               "binary file or another encoding"),
    ]
    for source, name, message in cases:
        with pytest.raises(ConfigError) as err:
            open_documents(source, (str(tmp_path / name),))
        assert str(err.value).startswith(message), str(err.value)
    assert open_documents("text", (str(tmp_path / "ok.txt"),)) == ["def f():\n    return 1\n"]
