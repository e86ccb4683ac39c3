"""Safetensors reader/writer and HF checkpoint loading, checked against independent oracles.

The golden tiny checkpoint (tests/data/golden) is in the release's exact format: 1,167
tensors, every dtype and quantised layout of spec model §2.2.
"""

from __future__ import annotations

import collections
import json
import math
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.checkpoint import hf
from dsv41_jax.checkpoint.safetensors import (
    DTYPES,
    SafetensorsError,
    SafetensorsFile,
    ShardedCheckpoint,
    save_file,
)
from dsv41_jax.testing import GOLDEN as _GOLDEN  # noqa: E402

GOLDEN = _GOLDEN / "tiny_hf"


@pytest.fixture(scope="module")
def golden() -> Path:
    if not (GOLDEN / "model.safetensors.index.json").is_file():
        pytest.skip(f"golden tiny checkpoint not found at {GOLDEN} (test data missing)")
    return GOLDEN


@pytest.fixture(scope="module")
def golden_params(golden):
    return hf.load_hf_params(golden)


def _raw_header(path: Path) -> tuple[int, dict]:
    """Header parsed with nothing but struct + json, as an independent view of the file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


# ----------------------------------------------------------------------------- independent oracles


def _e4m3_value(byte: int) -> float:
    """OCP E4M3 (fn) from its bits: bias 7, no inf, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_LUT = np.array([_e4m3_value(b) for b in range(256)], np.float64)
# All 16 E2M1 codes through ml_dtypes, which stores one float4 per byte in the low nibble.
E2M1_LUT = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def oracle_fp8_blocks(w_bytes: np.ndarray, s_bytes: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Loop over scale tiles; E4M3 decoded from bits; scale 2^(b-127) in float64."""
    vals = E4M3_LUT[w_bytes.view(np.uint8)]
    out = np.empty_like(vals)
    for i in range(s_bytes.shape[0]):
        for j in range(s_bytes.shape[1]):
            tile = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            out[tile] = vals[tile] * 2.0 ** (int(s_bytes.view(np.uint8)[i, j]) - 127)
    return out


def oracle_fp4_rows(packed: np.ndarray, s_bytes: np.ndarray) -> np.ndarray:
    """Per logical column: pick byte i//2, shift by 4*(i%2), look the code up among all 16."""
    u = packed.view(np.uint8).astype(np.int64)
    rows, cols = u.shape[0], 2 * u.shape[1]
    col = np.arange(cols)
    codes = (u[:, col // 2] >> (4 * (col % 2))) & 0xF
    exps = s_bytes.view(np.uint8).astype(np.int64)[:, col // 32] - 127
    return E2M1_LUT[codes] * np.exp2(exps.astype(np.float64)).reshape(rows, cols)


# ----------------------------------------------------------------------------- reader on the golden


def test_every_golden_tensor_reads_as_its_header_says(golden):
    ckpt = ShardedCheckpoint(golden)
    ckpt.validate()
    index = json.loads((golden / "model.safetensors.index.json").read_text())
    assert sorted(ckpt.keys()) == sorted(index["weight_map"]) and len(ckpt) == 1167
    counts, total = collections.Counter(), 0
    for shard in ckpt.shards():
        start, header = _raw_header(golden / shard)
        header.pop("__metadata__", None)
        raw = (golden / shard).read_bytes()
        for name, rec in header.items():
            a = ckpt.get(name)
            assert ckpt.shard_of(name) == shard
            assert a.dtype == DTYPES[rec["dtype"]] and a.shape == tuple(rec["shape"]), name
            begin, end = rec["data_offsets"]
            assert a.tobytes() == raw[start + begin : start + end], name
            assert not a.flags.owndata and not a.flags.writeable  # a view of the read-only map
            counts[rec["dtype"]] += 1
            total += end - begin
    assert counts == {"BF16": 124, "F32": 135, "F8_E4M3": 130, "F8_E8M0": 454, "I8": 324}
    assert total == index["metadata"]["total_size"] == 3_208_028


# ----------------------------------------------------------------------------- writer round trip


def _random_array(rng, dtype: np.dtype, shape) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    # Random bit patterns: NaNs, infs, subnormals and E8M0's 255 must survive bitwise.
    raw = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def test_round_trip_every_dtype_is_bitwise_exact(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    for i, (name, dt) in enumerate(sorted(DTYPES.items())):
        tensors[f"t.{name}"] = _random_array(rng, dt, (3, 5 + i))
        tensors[f"scalar.{name}"] = _random_array(rng, dt, ())
    tensors["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    tensors["strided"] = np.arange(60, dtype=np.float32).reshape(6, 10)[::2, ::3]
    tensors["big_endian"] = np.arange(7, dtype=">i4")
    path = tmp_path / "rt.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "é"})
    assert [p.name for p in tmp_path.iterdir()] == ["rt.safetensors"]  # no temp file left

    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "é"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, want in tensors.items():
            got = f.get(name)
            want_le = np.asarray(want, want.dtype.newbyteorder("<"))
            assert got.dtype == want_le.dtype and got.shape == want.shape, name
            assert got.tobytes() == want_le.tobytes(), name
            assert f.info(name).nbytes == want.nbytes


def test_written_header_follows_the_format(tmp_path):
    tensors = {"b": np.ones(3, np.uint8), "a": np.ones((2, 2), np.float64), "c": np.ones(5, np.int16)}
    path = tmp_path / "h.safetensors"
    save_file(tensors, path)
    start, header = _raw_header(path)
    raw = path.read_bytes()
    text = raw[8:start]
    assert start % 8 == 0 and text.rstrip(b" ").endswith(b"}")  # padded with spaces only
    spans = [rec["data_offsets"] for rec in header.values()]
    assert list(header) == ["a", "c", "b"] and spans == sorted(spans)  # widest dtype first; listed in data order
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # no holes
    assert spans[-1][1] == len(raw) - start
    for rec in header.values():  # every tensor naturally aligned in the file
        assert (start + rec["data_offsets"][0]) % DTYPES[rec["dtype"]].itemsize == 0
    save_file({"x": np.zeros(2, np.float32)}, path)  # overwrite in place
    assert SafetensorsFile(path).keys() == ["x"]


# ----------------------------------------------------------------------------- clear errors


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SafetensorsError, match=r"t\.safetensors.*'w'.*truncated"):
        SafetensorsFile(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsError, match="header length"):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    "rec, msg",
    [
        ({"dtype": "F4X", "shape": [2], "data_offsets": [0, 2]}, "unknown dtype 'F4X'"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12"),
        ({"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}, "run past the data buffer"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [5, 3]}, "bad data_offsets"),
        ({"dtype": "U8", "shape": [2]}, "malformed header entry"),
    ],
)
def test_bad_header_entries(tmp_path, rec, msg):
    path = _write_raw(tmp_path / "bad.safetensors", {"w.x": rec}, bytes(8))
    with pytest.raises(SafetensorsError, match=rf"bad\.safetensors: tensor 'w\.x': .*{re.escape(msg)}"):
        SafetensorsFile(path)


def test_index_name_missing_from_its_shard(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = ShardedCheckpoint(tmp_path)
    with pytest.raises(SafetensorsError, match=r"s1\.safetensors: tensor 'ghost' is listed"):
        ckpt.get("ghost")
    with pytest.raises(SafetensorsError, match=r"s1\.safetensors: 1 tensor.*'ghost'"):
        ckpt.validate()
    index["weight_map"]["b"] = "s2.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="shard 's2.safetensors' listed in the index is missing"):
        ShardedCheckpoint(tmp_path).get("b")


# ----------------------------------------------------------------------------- dequant math


def test_fp4_nibble_order_by_hand():
    # spec model §2.2: low nibble = even column; bit 3 = sign. 0x2F -> cols (0xF=-6, 0x2=1);
    # 0x81 -> cols (0x1=0.5, 0x8=-0). Scale byte 128 = 2^1.
    packed = np.array([[0x2F, 0x81] + [0] * 14], np.uint8).view(np.int8)
    scale = np.array([[128]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    out = hf._dequantize(packed, scale, (1, 32), np.empty((1, 32), np.float32))
    np.testing.assert_array_equal(out[0, :4], [-12.0, 2.0, 1.0, 0.0])
    assert np.signbit(out[0, 3]) and not out[0, 4:].any()


def test_e8m0_scale_extremes():
    s = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    got = hf._scale_f32(s)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    np.testing.assert_array_equal(got[:-1], np.float32(want))
    assert np.isnan(got[-1])  # b = 255 is NaN, spec model §2.2


def _fp8_bytes(rng, shape) -> np.ndarray:
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3F  # no NaN codes in weights
    return b.view(ml_dtypes.float8_e4m3fn)


def _e8m0(rng, shape) -> np.ndarray:
    return rng.integers(100, 150, shape, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


@pytest.mark.parametrize("rows, cols", [(96, 64), (70, 45)])  # exact tiles and ragged edge tiles
def test_fp8_block_dequant_matches_tile_loop(rows, cols):
    rng = np.random.default_rng(1)
    w = _fp8_bytes(rng, (rows, cols))
    s = _e8m0(rng, (-(-rows // 32), -(-cols // 32)))
    got = hf._dequantize(w, s, (32, 32), np.empty((rows, cols), np.float32))
    np.testing.assert_array_equal(got.astype(np.float64), oracle_fp8_blocks(w, s, 32, 32))


@pytest.mark.parametrize("cols", [96, 80])  # [rows, n] with [rows, ceil(n/32)]; 80 has a ragged last group
def test_engram_row_dequant_matches_tile_loop(cols):
    rng = np.random.default_rng(2)
    w, s = _fp8_bytes(rng, (37, cols)), _e8m0(rng, (37, 3))
    got = hf._dequantize(w, s, (1, 32), np.empty((37, cols), np.float32))
    np.testing.assert_array_equal(got.astype(np.float64), oracle_fp8_blocks(w, s, 1, 32))


def test_fp4_row_dequant_matches_nibble_lookup():
    rng = np.random.default_rng(3)
    packed = rng.integers(-128, 128, (40, 48), dtype=np.int8)  # logical [40, 96]
    s = _e8m0(rng, (40, 3))
    got = hf._dequantize(packed, s, (1, 32), np.empty((40, 96), np.float32))
    np.testing.assert_array_equal(got.astype(np.float64), oracle_fp4_rows(packed, s))


def test_row_chunking_is_invisible(monkeypatch):
    rng = np.random.default_rng(4)
    w, s = _fp8_bytes(rng, (100, 64)), _e8m0(rng, (4, 2))
    whole = hf._dequantize(w, s, (32, 32), np.empty((100, 64), np.float32))
    monkeypatch.setattr(hf, "_CHUNK_ELEMS", 64 * 40)  # 32-row chunks, ragged last chunk
    chunked = hf._dequantize(w, s, (32, 32), np.empty((100, 64), np.float32))
    np.testing.assert_array_equal(chunked, whole)


# ----------------------------------------------------------------------------- load_hf_params


def test_golden_formats_are_the_documented_tiles(golden):
    # The stored codes of every tile reach the top binade (scales rounded up from amax/448 per
    # 32x32 tile, or amax/6 per 32 FP4 values): proves the inferred tiling (README §1).
    ckpt = ShardedCheckpoint(golden)
    for plan in hf.plan_hf_params(ckpt).values():
        for src in plan.sources if plan.quantised else ():
            w, (br, bc) = ckpt.get(src.weight), src.block
            if src.stored == "I8":
                assert (br, bc) == (1, 32), src.weight
                amax = np.abs(hf._decode_fp4(w)).reshape(w.shape[0], -1, 32).max(-1)
                assert amax.min() >= 3 and amax.max() <= 6, src.weight
            else:
                assert (br, bc) == ((1, 32) if ".engram.embed." in src.weight else (32, 32))
                r, c = src.shape
                amax = np.abs(hf._decode_fp8(w)).reshape(r // br, br, c // bc, bc).max((1, 3))
                assert amax.min() >= 224 and amax.max() <= 448, src.weight


def test_golden_param_count_and_names(golden, golden_params):
    names = list(json.loads((golden / "model.safetensors.index.json").read_text())["weight_map"])
    scales = [n for n in names if n.endswith(".scale")]
    experts = [n for n in names if re.search(r"\.experts\.\d+\.", n) and n.endswith(".weight")]
    groups = {re.sub(r"\.experts\.\d+\.", ".experts.", n) for n in experts}
    assert len(golden_params) == len(names) - len(scales) - len(experts) + len(groups)
    assert len(golden_params) == 1167 - 454 - 324 + 45 == 434
    assert not any(n.endswith(".scale") or re.search(r"experts\.\d", n) for n in golden_params)
    for n in [
        "layers.3.attn.wq_a.weight",
        "layers.1.engram.embed.weight",
        "embed.weight",
        "norm.weight",
        "head.weight",
        "layers.0.hc_attn_fn",
        "layers.0.ffn.gate.bias",
        "mtp.0.main_proj.weight",
        "vision.blocks.0.attn.wqkv.weight",
    ]:
        assert golden_params[n].dtype == np.float32, n
    assert golden_params["layers.0.ffn.experts.w1.weight"].shape == (8, 64, 64)
    assert golden_params["mtp.2.ffn.experts.w2.weight"].shape == (4, 64, 64)


def test_every_index_tensor_consumed_exactly_once(golden):
    plans = hf.plan_hf_params(golden)
    used = collections.Counter(n for p in plans.values() for n in p.consumed())
    assert set(used.values()) == {1}
    assert set(used) == set(ShardedCheckpoint(golden).keys())


def test_golden_values_against_direct_dequant(golden, golden_params):
    ckpt = ShardedCheckpoint(golden)
    for e in range(8):  # slot e of the stack is expert e
        w = ckpt.get(f"layers.5.ffn.experts.{e}.w2.weight")
        s = ckpt.get(f"layers.5.ffn.experts.{e}.w2.scale")
        np.testing.assert_array_equal(golden_params["layers.5.ffn.experts.w2.weight"][e], oracle_fp4_rows(w, s))
    for name, block in [("layers.3.attn.wq_a", (32, 32)), ("layers.4.engram.embed", (1, 32))]:
        w, s = ckpt.get(f"{name}.weight"), ckpt.get(f"{name}.scale")
        np.testing.assert_array_equal(golden_params[f"{name}.weight"], oracle_fp8_blocks(w, s, *block))
    np.testing.assert_array_equal(golden_params["embed.weight"], ckpt.get("embed.weight").astype(np.float32))
    np.testing.assert_array_equal(golden_params["layers.0.hc_attn_fn"], ckpt.get("layers.0.hc_attn_fn"))


def test_include_and_dtype(golden, golden_params):
    want = {"embed.weight", "layers.2.ffn.experts.w3.weight"}
    got = hf.load_hf_params(golden, dtype=None, include=want.__contains__)
    assert set(got) == want and got["embed.weight"].dtype == ml_dtypes.bfloat16
    assert got["layers.2.ffn.experts.w3.weight"].dtype == np.float32
    bf = hf.load_hf_params(golden, dtype=ml_dtypes.bfloat16, include=want.__contains__)
    for n in want:  # FP8/FP4 x power-of-two and bf16 values are exact in bf16
        np.testing.assert_array_equal(bf[n].astype(np.float32), golden_params[n])


# ----------------------------------------------------------------------------- aliases and errors


@pytest.mark.parametrize(
    "hf_name, ours",
    [
        ("model.layers.3.self_attn.wq_a.weight_scale_inv", "layers.3.attn.wq_a.scale"),
        ("model.layers.0.mlp.gate.e_score_correction_bias", "layers.0.ffn.gate.bias"),
        ("model.layers.0.mlp.experts.7.w1.weight", "layers.0.ffn.experts.7.w1.weight"),
        ("model.vision.blocks.0.mlp.w1.weight", "vision.blocks.0.mlp.w1.weight"),
        ("mtp.1.ffn_norm.weight", "mtp.1.ffn_norm.weight"),
        ("layers.0.hc_attn_scale", "layers.0.hc_attn_scale"),
    ],
)
def test_canonical_name(hf_name, ours):
    assert hf.canonical_name(hf_name) == ours


def _hf_style(name: str) -> str:
    name = name.replace(".attn.", ".self_attn.").replace(".scale", ".weight_scale_inv")
    if not name.startswith("vision."):
        name = name.replace(".ffn.", ".mlp.")
        name = re.sub(r"\.gate\.bias$", ".gate.e_score_correction_bias", name)
    return "model." + name


def _save_sharded(tmp: Path, tensors: dict[str, np.ndarray], n_shards: int = 2) -> Path:
    names, weight_map = sorted(tensors), {}
    for k in range(n_shards):
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::n_shards]}
        save_file(part, tmp / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp


def test_hf_aliases_load_like_the_release(golden, golden_params, tmp_path):
    ckpt = ShardedCheckpoint(golden)
    keep = re.compile(r"^(layers\.[03]\.(attn|ffn)\.|vision\.blocks\.0\.mlp\.|embed\.weight)")
    orig = {n: ckpt.get(n) for n in ckpt.keys() if keep.match(n)}
    renamed = {_hf_style(n): a for n, a in orig.items()}
    renamed["mtp.0.embed.weight"] = orig["embed.weight"]  # dropped, spec model §2.6 step 4
    renamed["model.mtp.1.head.weight"] = orig["embed.weight"]
    for n in [
        "model.layers.3.self_attn.wq_a.weight_scale_inv",
        "model.layers.0.mlp.experts.7.w1.weight",
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.vision.blocks.0.mlp.w1.weight",
    ]:
        assert n in renamed, n
    got = hf.load_hf_params(_save_sharded(tmp_path, renamed))
    want = {n: golden_params[n] for n in golden_params if keep.match(n)}
    assert set(got) == set(want) and "vision.blocks.0.mlp.w1.weight" in got
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_expert_stack_uses_numeric_order(tmp_path):
    # 12 experts: a lexicographic sort would put expert 10 right after expert 1.
    rng = np.random.default_rng(5)
    tensors = {}
    for e in rng.permutation(12):
        tensors[f"layers.0.ffn.experts.{e}.w2.weight"] = np.full((2, 3), e, np.float32)
    got = hf.load_hf_params(_save_sharded(tmp_path, tensors, n_shards=3))["layers.0.ffn.experts.w2.weight"]
    np.testing.assert_array_equal(got[:, 0, 0], np.arange(12))


@pytest.mark.parametrize(
    "tensors, msg",
    [
        ({"a.scale": np.ones((1, 1), ml_dtypes.float8_e8m0fnu)}, r"'a\.scale': scale without its partner"),
        ({"a.weight": np.ones((32, 32), ml_dtypes.float8_e4m3fn)}, r"'a\.weight': F8_E4M3 weight without"),
        (
            {"embed.weight": np.ones(2, np.float32), "model.embed.weight": np.ones(2, np.float32)},
            "both map to 'embed.weight'",
        ),
        (
            {
                "a.weight": np.ones((32, 64), ml_dtypes.float8_e4m3fn),
                "a.scale": np.ones((1, 3), ml_dtypes.float8_e8m0fnu),
            },
            "does not tile",
        ),
        (
            {
                "layers.0.ffn.experts.0.w1.weight": np.ones(2, np.float32),
                "layers.0.ffn.experts.2.w1.weight": np.ones(2, np.float32),
            },
            r"indices \[0, 2\]",
        ),
    ],
)
def test_unconsumable_checkpoints_fail_with_names(tmp_path, tensors, msg):
    save_file(tensors, tmp_path / "model.safetensors")  # single-file checkpoint, no index
    with pytest.raises(SafetensorsError, match=msg):
        hf.load_hf_params(tmp_path)


def test_read_hf_config(golden):
    cfg = hf.read_hf_config(golden)
    assert isinstance(cfg, dict) and cfg == json.loads((golden / "config.json").read_text())
