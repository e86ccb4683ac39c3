"""``dsv41 export``: the release comes back byte for byte, float checkpoints land on the format's grid, and a
fine-tuned run exports, re-converts and scores to the logits of its own weights in the release format."""

from __future__ import annotations

import filecmp
import json

import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax import quant
from dsv41_jax.checkpoint import encode, hf, store
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.export import export
from dsv41_jax.checkpoint.inventory import expected_inventory
from dsv41_jax.checkpoint.plan import ConvertError
from dsv41_jax.checkpoint.safetensors import ShardedCheckpoint
from dsv41_jax.cli import main


def _arrays(ckpt_dir) -> dict[str, np.ndarray]:
    import jax

    params = ckpt_dir / "params"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {n: jax.ShapeDtypeStruct(s, d, sharding=one) for n, (s, d) in store.stored_arrays(params).items()}
    return {n: np.asarray(a) for n, a in store.restore_arrays(params, targets).items()}


def _files(d) -> list:
    return sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file())


def test_release_convert_native_export_is_the_release_byte_for_byte(golden_dir, golden_native, tmp_path, capsys):
    # every file: shards (tensors, their order and header), index, config.json, inference/config.json, tokenizer
    hf = golden_dir / "tiny_hf"  # golden_native: `dsv41 convert` with its default, --weights native
    assert main(["export", "--ckpt", str(golden_native), "--out", str(tmp_path / "hf")]) == 0
    assert "exported 1167 native tensors (3.2 MB) in 2 shards" in capsys.readouterr().err
    files = _files(hf)
    assert len(files) == 7 and _files(tmp_path / "hf") == files
    for f in files:
        assert filecmp.cmp(hf / f, tmp_path / "hf" / f, shallow=False), f


def test_bf16_export_holds_the_release_values_and_converts_back(golden_dir, golden_bf16, tmp_path):
    # export --weights bf16: every FP8 / FP4 weight one BF16 tensor of its logical shape, no scales, the config
    # files saying so; its values are the release's dequantised ones exactly (an E4M3 / E2M1 code times a power
    # of two fits bf16). Converted back (native: encoded by the release's rules) and exported natively again, the
    # release's config files come back byte for byte and every tensor holds the release's values (a scale byte
    # may be the rule's: a block whose largest code is 224 at scale s is 448 at s/2).
    release = golden_dir / "tiny_hf"
    bf16 = ShardedCheckpoint(golden_bf16)
    assert {bf16.info(n).dtype for n in bf16.keys()} == {"BF16", "F32"} and len(bf16.keys()) == 713
    assert bf16.info("layers.0.ffn.experts.0.w1.weight").shape == (64, 64)  # FP4 [64, 32] unpacked
    assert not any(n.endswith(".scale") for n in bf16.keys())
    assert "quantization_config" not in json.loads((golden_bf16 / "config.json").read_text())
    inference = json.loads((golden_bf16 / "inference/config.json").read_text())
    assert inference["dtype"] == "bf16" and "expert_dtype" not in inference
    want = hf.load_hf_params(release)
    got = hf.load_hf_params(golden_bf16)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name].astype(np.float32), value.astype(np.float32), err_msg=name)
    assert main(["convert", "--hf-dir", str(golden_bf16), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert main(["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    for f in ("config.json", "inference/config.json", "tokenizer.json"):
        assert filecmp.cmp(release / f, tmp_path / "hf" / f, shallow=False), f
    again = hf.load_hf_params(tmp_path / "hf")
    with ShardedCheckpoint(tmp_path / "hf") as back, ShardedCheckpoint(release) as ref:
        assert {n: (back.info(n).dtype, back.info(n).shape) for n in back.keys()} == \
            {n: (ref.info(n).dtype, ref.info(n).shape) for n in ref.keys()}
    for name, value in want.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_a_large_restore_reads_in_groups_with_a_progress_line(golden_native):
    import io

    import jax

    params = golden_native / "params"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {n: jax.ShapeDtypeStruct(s, d, sharding=one) for n, (s, d) in store.stored_arrays(params).items()}
    whole = store.restore_arrays(params, targets, progress=True, stream=io.StringIO())  # one group
    stream = io.StringIO()
    groups = store.restore_arrays(params, targets, group_bytes=1 << 20, stream=stream)  # 3.3 MB: four groups
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5 and all(line.startswith("restore ") and "ETA" in line for line in lines[:4]), lines
    assert "100.0%" in lines[3] and lines[4].startswith(f"restored {len(targets)} arrays (3.3 MB)"), lines
    assert set(groups) == set(whole)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.asarray(groups[name]), np.asarray(value), err_msg=name)


def test_a_float_checkpoint_exports_onto_the_same_values(tiny_converted, tmp_path):
    # fp32 conversion -> export (every FP8 / FP4 block re-encoded by the release's rule) -> convert: every array
    # of every subtree (DSpark, vision) holds the same values; the rule re-encodes a decoded block exactly
    export(tmp_path / "hf", ckpt=tiny_converted["fp32"], progress=False, shard_bytes=1 << 20)
    again = _arrays(convert(tmp_path / "hf", tmp_path / "back", weights="fp32", progress=False).out)
    first = _arrays(tiny_converted["fp32"])
    assert set(again) == set(first) and any(n.startswith("mtp.") for n in first)
    for name, value in first.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2  # the Engram tables sit alone


def test_encoding_keeps_a_known_scale_only_where_it_is_exact():
    rng = np.random.default_rng(0)
    codes = rng.choice([-224.0, -13.0, 0.5, 3.0, 96.0, 224.0], size=(64, 64)).astype(np.float32)
    codes[0, 0] = 3.0
    scale = np.array([[120, 121], [122, 123]], np.uint8)  # E8M0 bytes: 2^-7 .. 2^-4
    values = np.array(quant.dequant_fp8_blocks(codes.astype(ml_dtypes.float8_e4m3fn), scale))
    q, s = encode.fp8_blocks(values, (32, 32))
    np.testing.assert_array_equal(s, scale - 1)  # largest code 224: the rule halves the scale (codes 448) ...
    np.testing.assert_array_equal(quant.dequant_fp8_blocks(q, s), values)  # ... and holds the same values
    values[0, 0] += 2.0**-12  # one block changed off the hinted grid (3 + 1/32 at 2^-7), its amax kept
    q, s = encode.fp8_blocks(values, (32, 32), hint=scale)
    np.testing.assert_array_equal(s, [[119, 121], [122, 123]])  # kept where exact, the rule where not
    np.testing.assert_array_equal(q.astype(np.float32)[32:, 32:], codes[32:, 32:])


def _through_the_format(cfg: C.ModelConfig, name: str, value: np.ndarray) -> np.ndarray:
    """What the release format holds of a float value, by the rule (independent of the exporter)."""
    stored = {t.name: t.dtype for t in expected_inventory(cfg)}
    dtype = stored.get(name) or stored[name.replace(".experts.", ".experts.0.")]
    if dtype == "F32":
        return value
    if dtype == "BF16":
        return value.astype(ml_dtypes.bfloat16).astype(np.float32)
    if dtype == "I8":
        return np.stack([np.asarray(quant.dequant_fp4_rows(*quant.quantize_fp4_rows(v))) for v in value])
    block = (1, 32) if name.endswith("engram.embed.weight") else (32, 32)
    return np.asarray(quant.dequant_fp8_blocks(*quant.quantize_fp8_blocks(value, block=block), block=block))


# two layers (a ratio-2 and a ratio-1 index source, Engram at 0): the smallest step to compile
_MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2,
          "attention": {"compress_ratios": [2, 1, 0, 0, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                        "candidate_source_layer": 1},
          "engram": {"layer_ids": [0], "num_embeddings": [434]}, "dspark": {"target_layer_ids": [0, 1, 1]}}


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A model in the release format, converted (fp32), then fine-tuned for two steps by `dsv41 train`."""
    from dsv41_jax.checkpoint.fake_hf import write_fake_hf
    from dsv41_jax.train.config import from_dict
    from dsv41_jax.train.loop import train

    root = tmp_path_factory.mktemp("finetune")
    write_fake_hf(C.from_dict(_MODEL), root / "hf", seed=1, shard_bytes=1 << 20)
    convert(root / "hf", root / "src", weights="fp32", progress=False)
    train(from_dict({
        "model": _MODEL, "steps": 2, "checkpoint": {"dir": str(root / "run"), "every": 0},
        "data": {"max_documents": 30, "seq_len": 32, "batch_size": 2},
        "optim": {"lr": 1.0e-2, "warmup_steps": 1, "constant_until": 10, "decay_until": 20, "total_steps": 30,
                  "ns_steps": 1, "ns_tail_steps": 0, "sinkhorn_iters": 1, "indexer_kl_weight": 0.0},
        "posttrain": {"init_from": str(root / "src"), "lm_weight": 1.0}}, "export test"), log=lambda _: None)
    return root


@pytest.mark.slow  # two training steps of a two-layer model (~30 s on 2 shared cores, mostly the compile)
def test_a_finetuned_run_exports_reconverts_and_scores_to_its_own_logits(finetuned, tmp_path):
    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.posttrain.recipe import load_run_model
    from dsv41_jax.scoring import prefill_outputs

    root = finetuned
    assert main(["export", "--run", str(root / "run"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    assert main(["convert", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    ids = np.random.default_rng(0).integers(4, 512, (2, 40))
    np.save(tmp_path / "ids.npy", ids)
    assert main(["score", "--ckpt", str(tmp_path / "back"), "--ids", str(tmp_path / "ids.npy"), "--out",
                 str(tmp_path / "logits.npy"), "--param-dtype", "float32"]) == 0
    # the oracle: the run's own model, each weight put through the release format by the quant module
    model, hasher = load_run_model(root / "run")
    start, moved = _arrays(root / "src"), 0
    for name, var in flat_variables(model).items():
        value = np.asarray(var[...], np.float32)
        moved += not np.array_equal(value, start[name])
        var[...] = _through_the_format(model.cfg, name, value)
    assert moved > 10  # fine-tuning moved the weights off the grid they started on
    want = prefill_outputs(model, hasher, ids, "ids")["ids_prefill_logits"]
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), want)
    # the DSpark and vision arrays the run does not hold come from the checkpoint it was fine-tuned from
    names = ("mtp.0.main_proj.weight", "mtp.1.ffn.experts.w2.weight", "vision.blocks.0.attn.wqkv.weight",
             "image_newline")
    exported = hf.load_hf_params(tmp_path / "hf", include=lambda n: n in names)
    for name in names:
        np.testing.assert_array_equal(exported[name], start[name], err_msg=name)


def test_checkpoints_at_a_uri_convert_export_and_load_through_a_local_mirror(golden_dir, golden_native, gcs_bucket,
                                                                            tmp_path, monkeypatch, capsys):
    # gs://bucket/... served from a local directory through etils.epath (tests/conftest.py): the release there
    # converts to a URI, exports back to one byte for byte, loads by --ckpt URI on a machine with an empty mirror,
    # and a directory whose completion file (manifest, index) is missing is refused by name, never half-read.
    import shutil

    from dsv41_jax.checkpoint.convert import MANIFEST
    from dsv41_jax.checkpoint.load import load_model
    from dsv41_jax.config import ConfigError

    uri, bucket = gcs_bucket
    mirror = tmp_path / "mirror"
    monkeypatch.setenv("DSV41_RUN_MIRROR", str(mirror))
    release = golden_dir / "tiny_hf"
    shutil.copytree(release, bucket / "hf")
    assert main(["convert", "--hf-dir", f"{uri}/hf", "--out", f"{uri}/ckpt", "--quiet"]) == 0
    there = bucket / "ckpt"
    assert (there / MANIFEST).is_file() and _files(there / "params") == _files(golden_native / "params")
    for f in _files(golden_native / "params"):
        assert filecmp.cmp(golden_native / "params" / f, there / "params" / f, shallow=False), f

    shutil.rmtree(mirror)  # another machine
    assert main(["export", "--ckpt", f"{uri}/ckpt", "--out", f"{uri}/out", "--quiet"]) == 0
    assert _files(bucket / "out") == _files(release)
    for f in _files(release):
        assert filecmp.cmp(release / f, bucket / "out" / f, shallow=False), f
    with pytest.raises(ConvertError, match=r"--out gs://bucket/out exists and is not empty"):
        export(f"{uri}/out", ckpt=f"{uri}/ckpt", progress=False, log=lambda _: None)

    shutil.rmtree(mirror)
    loaded = load_model(ckpt=f"{uri}/ckpt", log=lambda _: None)
    local = load_model(ckpt=golden_native, log=lambda _: None)
    from dsv41_jax.checkpoint.tree import flat_variables

    want = flat_variables(local.model)
    for name, var in flat_variables(loaded.model).items():
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(want[name][...]), err_msg=name)

    # an upload cut off before its manifest: not a checkpoint; a conversion whose upload was cut off is sent again
    shutil.rmtree(mirror)
    (there / MANIFEST).unlink()
    with pytest.raises(ConfigError, match=r"--ckpt gs://bucket/ckpt: no dsv41_checkpoint.json there"):
        load_model(ckpt=f"{uri}/ckpt", log=lambda _: None)
    shutil.rmtree(there)
    shutil.copytree(golden_native, mirror / "gs" / "bucket" / "ckpt")  # converted here, nothing copied up yet
    result = convert(f"{uri}/hf", f"{uri}/ckpt", weights="native", progress=False)
    assert result.written == 0 and result.out == f"{uri}/ckpt" and (there / MANIFEST).is_file()
    with pytest.raises(ConvertError, match=r"--out gs://bucket/ckpt holds a finished conversion"):
        convert(f"{uri}/hf", f"{uri}/ckpt", weights="native", progress=False)
