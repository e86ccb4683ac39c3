"""Bad input to the ``dsv41`` command is one line and exit code 2, before any model is built: option ranges
(argparse's own format), malformed id lists, prompts that do not fit, and an output that holds a checkpoint."""

from __future__ import annotations

import json

import pytest

from dsv41_jax.cli import main
from dsv41_jax.testing import GOLDEN

HF = str(GOLDEN / "tiny_hf")


def _error(capsys, argv: list[str], code: int = 2) -> str:
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse
        got = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert got == code and err, (got, err)
    return err[-1]


@pytest.mark.parametrize("argv, message", [
    (["sample", "--hf-dir", HF, "--ids", "0,a,2"], "dsv41 sample: error: argument --ids: '0,a,2': expected "
     "comma-separated non-negative token ids like 0,17,42 ('a' is not one)"),
    (["sample", "--hf-dir", HF, "--ids", "0,,2"], "argument --ids: '0,,2': expected comma-separated"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--top-p", "1.5"], "argument --top-p: 1.5: must be in (0, 1]"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--top-p", "0"], "argument --top-p: 0: must be in (0, 1]"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--temperature", "-0.5"], "argument --temperature: -0.5: must be ≥ 0"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--temperature", "nan"], "'nan': must be a finite number"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--max-new-tokens", "0"], "argument --max-new-tokens: 0: must be ≥ 1"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--top-k", "-1"], "argument --top-k: -1: must be ≥ 0"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--prefill-chunk", "x"], "argument --prefill-chunk: 'x': not an integer"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--max-seq-len", "1"], "argument --max-seq-len: 1: must be ≥ 2"),
    (["make-fake-hf", "--config", "tiny", "--out", "x", "--shard-mb", "0"], "argument --shard-mb: 0: must be > 0"),
    (["make-fake-hf", "--config", "tiny", "--out", "x", "--seed", "-1"], "argument --seed: -1: must be ≥ 0"),
    (["convert", "--hf-dir", HF, "--out", "x", "--chunk-mb", "-4"], "argument --chunk-mb: -4: must be > 0"),
    (["train", "--config", "x.yaml", "--stop-after", "0"], "argument --stop-after: 0: must be ≥ 1"),
    (["train", "--config", "x.yaml", "--preflight", "--devices", "0"], "argument --devices: 0: must be ≥ 1"),
    (["eval-served", "--run", "r", "--data", "d", "--boundaries", "cold,-3"], "argument --boundaries: 'cold,-3': "
     "expected 'cold' or positive positions, comma-separated ('-3' is neither)"),
    (["eval-served", "--run", "r", "--data", "d", "--batch-size", "0"], "argument --batch-size: 0: must be ≥ 1"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--verify-widths", "0,2"], "argument --verify-widths: '0,2': expected "
     "widths ≥ 1 separated by commas"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--verify-widths", "1,3"], "error: --verify-widths needs --speculative"),
    (["sample", "--hf-dir", HF, "--ids", "1", "--sps", "sps.json"], "error: --sps needs --speculative"),
])
def test_option_ranges(capsys, argv, message):
    assert message in _error(capsys, argv)


@pytest.mark.parametrize("ids, message", [
    (",".join(["5"] * 40), "error: --ids: prompt 0 has 40 tokens; max_seq_len is 16 (room to generate needed)"),
    ("0,17,99999", "error: --ids: prompt 0 has token ids outside [0, 512): [99999]"),
])
def test_prompts_that_cannot_be_generated_from(capsys, ids, message):
    assert _error(capsys, ["sample", "--hf-dir", HF, "--ids", ids, "--max-seq-len", "16", "--dtype", "fp32"]) \
        == message


def test_make_fake_hf_refuses_to_replace_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"mine": True}))
    (out / "notes.txt").write_text("kept")
    assert _error(capsys, ["make-fake-hf", "--config", "tiny", "--out", str(out)]) == (
        f"error: --out {out} holds a checkpoint; random weights would replace it. Choose a new directory, or pass "
        "--overwrite to replace its checkpoint files")
    assert json.loads((out / "config.json").read_text()) == {"mine": True}
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale shard")
    assert main(["make-fake-hf", "--config", "tiny", "--out", str(out), "--overwrite", "--shard-mb", "64"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
                     "model.safetensors.index.json", "notes.txt", "tokenizer.json", "tokenizer_config.json"], names
    assert "text_config" in json.loads((out / "config.json").read_text())


def test_speculative_verify_widths_and_sps_tables(tmp_path, capsys):
    """A steps-per-second table fixes the verify widths and the batch it was measured at: other widths, another K
    or another batch is refused by name, before anything compiles."""
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"batch": 1, "context": 8, "widths": [1, 3], "steps_per_s": [9.0, 7.0],
                                 "sps": [9.0, 9.0, 7.0, 7.0]}))
    spec = ["sample", "--hf-dir", HF, "--ids", "5,6,7", "--dtype", "fp32", "--speculative", "dspark:2"]
    assert _error(capsys, [*spec, "--sps", str(table), "--verify-widths", "2,3"]) == (
        f"error: --verify-widths 2,3: the --sps table {table} was measured at widths 1,3; profile again with those "
        "--verify-widths")
    assert _error(capsys, [*spec[:-1], "dspark:4", "--sps", str(table)]) == (
        f"error: --sps {table}: measured up to 2 drafts per step, but --speculative verifies 4; profile with dsv41 "
        "profile-sps --drafts 4")
    assert _error(capsys, [*spec, "--ids", "8", "--sps", str(table)]) == (  # the table's rates are batch 1's
        f"error: --sps {table}: measured at batch 1, but 2 prompts are sampled; profile with dsv41 profile-sps "
        "--batch 2")
    assert _error(capsys, [*spec, "--verify-widths", "2,5"]).startswith(
        "error: --verify-widths: verify widths (2, 5): each must lie in 1..3")
    assert _error(capsys, ["profile-sps", "--hf-dir", HF, "--drafts", "2", "--verify-widths", "1,2"]).startswith(
        "error: --verify-widths: verify widths (1, 2): each must lie in 1..3")
    for bad in ({"sps": [1.0]}, {"sps": [1.0], "widths": []}, {"sps": [1.0], "widths": [3, 1]}):
        table.write_text(json.dumps(bad))
        assert _error(capsys, [*spec, "--sps", str(table)]).startswith(f"error: --sps {table}: not a table written by")
