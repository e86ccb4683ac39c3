"""``dsv41 convert``: exact round trips, every subtree, resumability, mesh-aligned storage, progress."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax import quant
from dsv41_jax.checkpoint import convert as convert_mod
from dsv41_jax.checkpoint import hf, store
from dsv41_jax.checkpoint.convert import MANIFEST, ConvertError, convert, parse_mesh
from dsv41_jax.checkpoint.fake_hf import write_fake_hf
from dsv41_jax.checkpoint.inventory import expected_inventory
from dsv41_jax.checkpoint.load import model_from_orbax
from dsv41_jax.checkpoint.progress import Progress
from dsv41_jax.checkpoint.tree import flat_variables
from dsv41_jax.testing import fake_cpu_env


def _stored_dtype(name: str) -> str:
    """Release dtype of one of our names (experts: that of expert 0)."""
    inv = {t.name: t.dtype for t in expected_inventory(C.tiny())}
    return inv.get(name) or inv[name.replace(".experts.", ".experts.0.")]


def _through_the_format(name: str, value: np.ndarray) -> np.ndarray:
    """What the release format can hold of ``value`` (spec model §2.2): the oracle of a round trip."""
    dtype = _stored_dtype(name)
    if dtype == "F32":
        return value
    if dtype == "BF16":
        return value.astype(np.dtype("bfloat16")).astype(np.float32)
    if dtype == "I8":
        return np.asarray(quant.dequant_fp4_rows(*quant.quantize_fp4_rows(value)))
    block = (1, 32) if name.endswith("engram.embed.weight") else (32, 32)
    return np.asarray(quant.dequant_fp8_blocks(*quant.quantize_fp8_blocks(value, block=block), block=block))


def _all_arrays(ckpt_dir) -> dict[str, np.ndarray]:
    import jax

    params = ckpt_dir / "params"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {n: jax.ShapeDtypeStruct(s, d, sharding=one) for n, (s, d) in store.stored_arrays(params).items()}
    return {n: np.asarray(a) for n, a in store.restore_arrays(params, targets).items()}


def test_round_trip_fp32_is_exact_where_lossless(tiny_params, tiny_converted):
    # random model -> make-fake-hf -> convert fp32 -> restore: F32 tensors bit-identical, the others exactly
    # what their stored format holds (bf16 rounding, FP8 blocks, FP4 rows)
    model, _ = model_from_orbax(tiny_converted["fp32"])
    restored = {n: np.asarray(v[...]) for n, v in flat_variables(model).items()}
    assert set(restored) == set(tiny_params)
    for name, value in tiny_params.items():
        np.testing.assert_array_equal(restored[name], _through_the_format(name, value), err_msg=name)
    assert sum(_stored_dtype(n) == "F32" for n in tiny_params) > 100  # mHC, sinks, router biases


def test_round_trip_is_the_identity_on_the_format_grid(tmp_path, tiny_converted):
    # parameters that came out of the format go back in and out unchanged, bit for bit, every subtree
    first = _all_arrays(tiny_converted["fp32"])
    write_fake_hf(C.tiny(), tmp_path / "hf", seed=11, params=first, shard_bytes=1 << 20)
    again = _all_arrays(convert(tmp_path / "hf", tmp_path / "out", progress=False).out)
    assert set(again) == set(first)
    for name in first:
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)


def test_every_subtree_is_converted_under_its_own_name(tiny_hf, tiny_converted):
    # DSpark, vision, aligner and image delimiters included (the model does not use them yet)
    arrays = _all_arrays(tiny_converted["fp32"])
    direct = hf.load_hf_params(tiny_hf)  # the independent in-memory loader
    assert set(arrays) == set(direct)
    for prefix in ("mtp.0.main_proj", "mtp.2.markov_head", "mtp.1.ffn.experts.w2", "vision.blocks.0.attn.wqkv",
                   "aligner.w1", "image_newline"):
        assert any(n.startswith(prefix) for n in arrays), prefix
    for name, value in direct.items():
        np.testing.assert_array_equal(arrays[name], value, err_msg=name)


def test_native_bf16_and_fp32_hold_the_same_values(tiny_converted):
    fp32, bf16, native = (_all_arrays(tiny_converted[m]) for m in ("fp32", "bf16", "native"))
    assert set(bf16) == set(fp32) and set(native) - set(fp32) == {n for n in native if n.endswith(".scale")}
    for name, value in fp32.items():
        np.testing.assert_array_equal(bf16[name].astype(np.float32), value, err_msg=name)  # dequant is exact
        scale = native.get(name[: -len("weight")] + "scale")
        if scale is None or native[name].dtype == np.dtype("bfloat16"):  # wo_a keeps its source scale beside it
            np.testing.assert_array_equal(native[name].astype(np.float32), value, err_msg=name)
        elif native[name].ndim == 3:
            np.testing.assert_array_equal(quant.dequant_fp4_rows(native[name], scale), value, err_msg=name)
        else:
            block = (1, 32) if name.endswith("engram.embed.weight") else (32, 32)
            np.testing.assert_array_equal(quant.dequant_fp8_blocks(native[name], scale, block=block), value)
    assert native["layers.0.attn.wq_a.weight"].dtype == np.dtype("float8_e4m3fn")
    assert native["layers.0.ffn.experts.w1.weight"].dtype == np.uint8
    assert native["layers.0.attn.wo_a.weight"].dtype == np.dtype("bfloat16")  # as the reference holds it (§2.5)
    assert native["layers.0.attn.wo_a.scale"].dtype == np.uint8  # the source's, for export
    manifest = json.loads((tiny_converted["native"] / MANIFEST).read_text())
    assert manifest["weight_format"] == "native" and manifest["n_arrays"] == len(native)


def test_interrupted_conversion_resumes_without_redoing_work(tmp_path, monkeypatch, tiny_hf, tiny_converted):
    real_write, calls = convert_mod._write, []

    def flaky(out, ckpt, params_dir, *args):
        calls.append(out.name)
        if len(calls) == 25:  # die half-way through an array: its directory exists but is incomplete
            store.create_array(params_dir, out.name, out.shape, out.dtype, out.shape)
            raise KeyboardInterrupt
        return real_write(out, ckpt, params_dir, *args)

    monkeypatch.setattr(convert_mod, "_write", flaky)
    out = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf, out, chunk_bytes=64 << 10, progress=False)
    assert not out.exists() and (tmp_path / "ckpt.partial" / "journal.jsonl").is_file()
    with open(tmp_path / "ckpt.partial" / "journal.jsonl", "a") as journal:
        journal.write('{"name": "layers.0.torn')  # a line cut by the interruption
    monkeypatch.setattr(convert_mod, "_write", real_write)
    result = convert(tiny_hf, out, chunk_bytes=64 << 10, progress=False)
    assert (result.skipped, result.written) == (24, result.n_arrays - 24)
    assert not (tmp_path / "ckpt.partial").exists() and (out / MANIFEST).is_file()
    resumed, reference = _all_arrays(out), _all_arrays(tiny_converted["fp32"])
    assert set(resumed) == set(reference)
    for name in reference:
        np.testing.assert_array_equal(resumed[name], reference[name], err_msg=name)


def test_resume_refuses_other_settings(tmp_path, tiny_hf):
    (tmp_path / "ckpt.partial" / "params").mkdir(parents=True)
    (tmp_path / "ckpt.partial" / "convert.json").write_text('{"weights": "native"}')
    with pytest.raises(ConvertError, match=r"other settings \(source, weights\).*delete it"):
        convert(tiny_hf, tmp_path / "ckpt", progress=False)


def test_output_must_be_new(tiny_hf, tiny_converted):
    with pytest.raises(ConvertError, match="holds a finished conversion"):
        convert(tiny_hf, tiny_converted["fp32"], progress=False)


def test_progress_reports_bytes_rate_and_eta(capsys):
    prog = Progress(4_000_000_000, 1_000_000_000, interval=0)
    prog.advance(500_000_000, "layers.3.ffn.experts.w1.weight")
    line = capsys.readouterr().err
    assert "1.5 GB / 4.0 GB" in line and "37.5%" in line and "/s" in line and "ETA" in line
    assert "layers.3.ffn.experts.w1.weight" in line


def test_mesh_aligned_chunks_never_straddle_a_shard(tmp_path, tiny_hf):
    mesh = parse_mesh("fsdp=2,expert=2,tensor=2")
    out = convert(tiny_hf, tmp_path / "ckpt", weights="native", mesh=mesh, chunk_bytes=8 << 10, progress=False).out
    blocks = convert_mod._mesh_blocks(C.tiny(), "native", mesh)
    assert any(b != tuple(json.loads((out / "params" / n / ".zarray").read_text())["shape"])
               for n, b in blocks.items())  # some arrays are really sharded
    for name, block in blocks.items():
        zarray = json.loads((out / "params" / name / ".zarray").read_text())
        for dim, size, chunk in zip(zarray["shape"], block, zarray["chunks"], strict=True):
            assert chunk <= size and (size == dim or size % chunk == 0), (name, block, zarray["chunks"])


def test_sharded_restore_on_eight_devices(tiny_converted):
    # in a fresh process with 8 CPU devices: every array lands on the devices its partition spec names
    code = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import AxisType
        from dsv41_jax.checkpoint.load import model_from_orbax
        from dsv41_jax.checkpoint.tree import flat_variables
        mesh = jax.make_mesh((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"), axis_types=(AxisType.Explicit,) * 4)
        sharded, _ = model_from_orbax({str(tiny_converted["native"])!r}, mesh=mesh)
        plain, _ = model_from_orbax({str(tiny_converted["native"])!r})
        ref = flat_variables(plain)
        split = 0
        for name, var in flat_variables(sharded).items():
            a = var[...]
            assert a.sharding.mesh.shape == mesh.shape, name
            split += len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated
            np.testing.assert_array_equal(np.asarray(a), np.asarray(ref[name][...]), err_msg=name)
        assert split > 50, split
        print("ok", split)
    """)
    env = fake_cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
