"""What is on disk is checked before it is trusted: a safetensors header whose byte ranges do not tile the data
(shifted, overlapping, gaps, trailing bytes) is refused by the reader and so by ``dsv41 convert``; a converted
checkpoint or release directory that is damaged, and an unreadable ``config.json``, are one ``error:`` line and
exit code 2 from ``dsv41 sample`` / ``dsv41 score``, before anything is compiled."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.safetensors import SafetensorsError, SafetensorsFile, save_file
from dsv41_jax.cli import main
from dsv41_jax.testing import GOLDEN

INDEX = "model.safetensors.index.json"


def _read(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def _write(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _shift(path, name: str, by: int) -> None:
    header, data = _read(path)
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + by, end + by]
    _write(path, header, data)


@pytest.fixture
def three(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 3), np.float32),
               "c": np.full(5, 7, np.int8)}, path)
    return path


def _order(path) -> list[str]:
    header, _ = _read(path)
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def test_ranges_that_do_not_tile_the_data_are_refused(three):
    first, middle, last = _order(three)
    with SafetensorsFile(three) as f:  # the intact file reads
        np.testing.assert_array_equal(f.get("a"), np.arange(4, dtype=np.float32))
    header, data = _read(three)
    cases = {
        "overlaps": (lambda: _shift(three, last, -1), f"tensor {last!r}: data_offsets .* overlaps {middle!r}"),
        "gap": (lambda: _shift(three, first, 2), f"tensor {first!r}: data_offsets .* leaves bytes \\[0, 2\\) unused "
                "after the header"),
        "trailing": (lambda: _write(three, header, data + b"\0" * 8), "the tensors end at byte .* trailing bytes"),
    }
    for damage, message in cases.values():
        _write(three, header, data)
        damage()
        with pytest.raises(SafetensorsError, match=message):
            SafetensorsFile(three)


def test_convert_refuses_a_shard_with_shifted_ranges(tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(GOLDEN / "tiny_hf", hf)
    shard = hf / sorted(set(json.loads((hf / INDEX).read_text())["weight_map"].values()))[0]
    name = _order(shard)[-1]
    _shift(shard, name, -4)
    assert main(["convert", "--hf-dir", str(hf), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"tensor {name!r}" in err[0] and "overlaps" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert(GOLDEN / "tiny_hf", tmp_path_factory.mktemp("conv") / "ckpt", weights="native", progress=False).out


def _truncate_an_array(d):
    chunk = next(p for p in sorted((d / "params").rglob("0.0")) if "attn.wkv.weight" in str(p))
    chunk.write_bytes(chunk.read_bytes()[:10])
    return f"{chunk}\": Truncated Zstd-compressed stream"


def _garbage_config(d):
    (d / "config.json").write_text("{not json")
    return f"error: {d}/config.json: cannot read the config: Expecting property name"


def _no_metadata(d):
    (d / "params" / "_METADATA").unlink()
    return f"error: --ckpt {d}: cannot load the checkpoint: {d}/params: not an Orbax checkpoint (no _METADATA)"


def _no_tokenizer(d):
    (d / "tokenizer.json").unlink()
    return f"error: --ckpt {d}: no tokenizer.json"


@pytest.mark.parametrize("damage", [_truncate_an_array, _garbage_config, _no_metadata, _no_tokenizer])
@pytest.mark.parametrize("command", ["sample", "score"])
def test_a_damaged_converted_checkpoint_is_one_line(converted, tmp_path, capsys, damage, command):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    want = damage(ckpt)
    np.save(tmp_path / "ids.npy", np.zeros((1, 4), np.int32))
    args = ["--ids", "0,17"] if command == "sample" else ["--ids", str(tmp_path / "ids.npy")]
    assert main([command, "--ckpt", str(ckpt), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err


def test_a_damaged_release_directory_is_one_line(tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(GOLDEN / "tiny_hf", hf)
    shard = hf / sorted(set(json.loads((hf / INDEX).read_text())["weight_map"].values()))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["sample", "--hf-dir", str(hf), "--ids", "0,17"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --hf-dir {hf}: cannot load the checkpoint: {shard}"), err
