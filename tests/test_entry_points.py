"""train/ and infer/: thin entry points over the library (each <= 70 lines, its usage in its docstring and
--help) that call the same library function as the `dsv41` command they mirror and give the same results."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import cli
from dsv41_jax.checkpoint.load import model_from_hf

REPO = Path(__file__).resolve().parents[1]

SCRIPTS = ["infer/convert_and_score.py", "infer/generate.py", "train/pretrain.py"]


def load_script(rel: str):
    """The script as a module (its ``main`` runs in this process)."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(f"entry_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_is_listed():
    found = sorted(str(p.relative_to(REPO)) for d in ("train", "infer") for p in (REPO / d).glob("*.py"))
    assert found == SCRIPTS


@pytest.mark.parametrize("rel", SCRIPTS)
def test_help_exits_zero_and_shows_the_usage(rel, capsys):
    assert len((REPO / rel).read_text().splitlines()) <= 70, f"{rel}: entry points stay thin (<= 70 lines)"
    with pytest.raises(SystemExit) as exit_:
        load_script(rel).main(["--help"])
    assert exit_.value.code == 0
    assert f"python {rel} " in capsys.readouterr().out  # the docstring's usage line


def _record(monkeypatch, module, name: str) -> list[tuple[tuple, dict]]:
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append((a, k)))
    return calls


def test_script_and_command_call_one_library_function(monkeypatch, tmp_path):
    """Each script and its `dsv41` subcommand end in the same library call, with the same values for the
    arguments both pass (the scripts may leave more of them at their defaults)."""
    import dsv41_jax.checkpoint.convert
    import dsv41_jax.sample
    import dsv41_jax.scoring
    import dsv41_jax.train.loop

    def same(calls):
        (sa, sk), (ca, ck) = calls
        assert sa == ca and {k: ck[k] for k in sk} == sk, calls

    calls = _record(monkeypatch, dsv41_jax.train.loop, "launch")
    assert load_script("train/pretrain.py").main(["run.yaml", "steps=3", "--stop-after", "2"]) == 0
    assert cli.main(["train", "--config", "run.yaml", "steps=3", "--stop-after", "2"]) == 0
    same(calls)

    calls = _record(monkeypatch, dsv41_jax.sample, "sample")
    args = ["--hf-dir", "hf", "--ids", "0,17", "--ids", "5", "--temperature", "0.5", "--dtype", "float32"]
    assert load_script("infer/generate.py").main(args) == 0
    assert cli.main(["sample", *args]) == 0
    same(calls)
    assert calls[0][1]["ids"] == [[0, 17], [5]]

    calls = _record(monkeypatch, dsv41_jax.scoring, "score")
    converted = _record(monkeypatch, dsv41_jax.checkpoint.convert, "convert")
    ckpt = str(tmp_path / "ckpt")
    assert load_script("infer/convert_and_score.py").main(["--hf-dir", "hf", "--out", ckpt, "--inputs", "in.npz",
                                                          "--reference", "ref.npz", "--scores", "ours.npz"]) == 0
    assert converted == [(("hf", Path(ckpt)), {"weights": "fp32"})]
    assert cli.main(["score", "--ckpt", ckpt, "--inputs", "in.npz", "--reference", "ref.npz",
                     "--out", "ours.npz"]) == 0
    (_, script), (_, command) = calls
    assert {k: command[k] for k in script} == script | {"ckpt": ckpt}, calls


def test_pretrain_preflight_equals_dsv41_train_preflight(capsys):
    config = str(REPO / "configs" / "v41_flash_pretrain.yaml")
    assert load_script("train/pretrain.py").main([config, "--preflight", "--devices", "64"]) == 0
    ours = capsys.readouterr().out
    assert cli.main(["train", "--config", config, "--preflight", "--devices", "64"]) == 0
    assert ours == capsys.readouterr().out and ours.startswith("preflight: mesh")


def _generated_ids(out: str) -> list[list[int]]:
    return [[int(t) for t in m.split(",")] for m in re.findall(r"^\[\d+\] ids (\S+)$", out, re.MULTILINE)]


@pytest.mark.slow  # two compiled generators and a forward on the golden checkpoint (~45 s on 2 shared cores)
def test_generate_gives_the_tokens_of_dsv41_sample(golden_dir, capsys):
    """Greedy ids from infer/generate.py equal `dsv41 sample`'s, and each is the argmax of the training forward
    over the prompt and the tokens before it."""
    hf = str(golden_dir / "tiny_hf")
    args = ["--hf-dir", hf, "--ids", "0,17,42", "--max-new-tokens", "4", "--dtype", "float32", "--show-ids"]
    assert load_script("infer/generate.py").main(args) == 0
    ours = _generated_ids(capsys.readouterr().out)
    assert cli.main(["sample", *args]) == 0
    assert ours == _generated_ids(capsys.readouterr().out)
    assert len(ours) == 1 and len(ours[0]) == 4  # the golden model does not stop early on this prompt

    model, hasher = model_from_hf(hf)
    seq = np.array([[0, 17, 42, *ours[0]]])
    rows, _ = hasher.row_ids(seq)
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda st, t, r: nnx.merge(graphdef, st)(t, r))(state, seq, rows)
    assert np.asarray(logits)[0, 2:-1].argmax(-1).tolist() == ours[0]


@pytest.mark.slow  # converts and scores the golden checkpoint (~25 s)
def test_convert_and_score_on_the_golden_checkpoint(golden_dir, tmp_path, capsys):
    """Converted, then scored against the reference's fp32 outputs: every discrete decision agrees and the
    logits sit at fp32 rounding (tests/model/test_golden.py holds the same bounds for the HF loader)."""
    script = load_script("infer/convert_and_score.py")
    assert script.main(["--hf-dir", str(golden_dir / "tiny_hf"), "--out", str(tmp_path / "ckpt"),
                        "--inputs", str(golden_dir / "inputs.npz"), "--reference", str(golden_dir / "ref_fp32.npz"),
                        "--scores", str(tmp_path / "ours.npz"), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    discrete = {k: r["row_agreement"] for k, r in report.items() if "row_agreement" in r}
    assert {"batch1_engram_row_ids", "batch2_moe_topk", "batch1_candidates_6", "batch2_topk_10"} <= set(discrete)
    assert all(v == 1.0 for v in discrete.values()), discrete
    for tag in ("batch1", "batch2"):
        logits = report[f"{tag}_prefill_logits"]
        assert logits["median"] < 2e-6 and logits["max"] < 1e-3 and logits["argmax_agreement"] == 1.0, logits
    assert set(np.load(tmp_path / "ours.npz").files) >= set(report)
