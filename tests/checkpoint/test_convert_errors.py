"""Every way a download or its config can be wrong is a clear error, naming the tensors, before any write."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from dsv41_jax.checkpoint.convert import ConvertError, convert
from dsv41_jax.checkpoint.safetensors import SafetensorsFile, save_file
from dsv41_jax.cli import main

INDEX = "model.safetensors.index.json"


@pytest.fixture
def broken(tmp_path, tiny_hf):
    """A private copy of the tiny checkpoint to damage."""
    shutil.copytree(tiny_hf, tmp_path / "hf")
    return tmp_path / "hf"


def _rewrite(hf_dir, edit) -> None:
    """Apply ``edit`` to {name: array} of the whole checkpoint; new names land in the first shard."""
    index = json.loads((hf_dir / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    tensors = {}
    for shard in shards:
        with SafetensorsFile(hf_dir / shard) as f:
            tensors |= {n: np.array(f.get(n)) for n in f.keys()}
    edit(tensors)
    where = {n: index["weight_map"].get(n, shards[0]) for n in tensors}
    for shard in shards:
        save_file({n: a for n, a in tensors.items() if where[n] == shard}, hf_dir / shard)
    index["weight_map"] = dict(sorted(where.items()))
    index["metadata"]["total_size"] = sum(a.nbytes for a in tensors.values())
    (hf_dir / INDEX).write_text(json.dumps(index))


def _edit_config(hf_dir, **text) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["text_config"] |= text
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def _fails(hf_dir, out, *patterns: str) -> str:
    with pytest.raises(ConvertError) as err:
        convert(hf_dir, out, progress=False)
    for p in patterns:
        assert p in str(err.value), (p, str(err.value))
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()  # nothing written
    return str(err.value)


def _shard(hf_dir, i: int):
    return sorted(hf_dir.glob("model-*-of-*.safetensors"))[i]


def test_missing_shard(broken, tmp_path):
    shard = _shard(broken, 1)
    shard.unlink()
    _fails(broken, tmp_path / "out", f"shard '{shard.name}' listed in the index is missing")


def test_truncated_shard(broken, tmp_path):
    shard = _shard(broken, 2)
    shard.write_bytes(shard.read_bytes()[:-1000])
    _fails(broken, tmp_path / "out", shard.name, "truncated")


def test_extra_tensor(broken, tmp_path):
    _rewrite(broken, lambda t: t.update({"layers.0.attn.wq_c.weight": np.zeros((4, 4), np.float32)}))
    _fails(broken, tmp_path / "out", "unexpected (1): layers.0.attn.wq_c.weight")


def test_renamed_tensor(broken, tmp_path):
    _rewrite(broken, lambda t: t.update({"layers.3.attn.q_nrm.weight": t.pop("layers.3.attn.q_norm.weight")}))
    _fails(broken, tmp_path / "out", "missing (1): layers.3.attn.q_norm.weight",
           "unexpected (1): layers.3.attn.q_nrm.weight", "a renamed tensor")


def test_partial_download_lists_what_is_missing(broken, tmp_path):
    _rewrite(broken, lambda t: [t.pop(n) for n in list(t) if n.startswith("layers.11.")])
    msg = _fails(broken, tmp_path / "out", "missing (", "layers.11.attn.wq_a.weight", "partial download")
    assert "unexpected (" not in msg


def test_config_of_another_size(broken, tmp_path):
    # weights of moe_intermediate_size 64, config.json claiming 96: every expert and shared-expert tensor
    _edit_config(broken, moe_intermediate_size=96)
    _fails(broken, tmp_path / "out", "dtype/shape (", "layers.0.ffn.experts.0.w1.weight is I8[64, 32], config implies "
           "I8[96, 32]", "config.json")


def test_config_with_more_experts(broken, tmp_path):
    _edit_config(broken, n_routed_experts=9)
    _fails(broken, tmp_path / "out", "layers.0.ffn.experts.8.w1.weight", "dtype/shape",
           "ffn.gate.weight is BF16[8, 64]")


def test_wrong_dtype(broken, tmp_path):
    _rewrite(broken, lambda t: t.update({"norm.weight": t["norm.weight"].astype(np.float32)}))
    _fails(broken, tmp_path / "out", "norm.weight is F32[64], config implies BF16[64]")


def test_index_total_size_of_another_download(broken, tmp_path):
    index = json.loads((broken / INDEX).read_text())
    index["metadata"]["total_size"] += 2
    (broken / INDEX).write_text(json.dumps(index))
    _fails(broken, tmp_path / "out", "metadata.total_size")


def test_tokenizer_that_does_not_fit_the_config(broken, tmp_path):
    _edit_config(broken, engram_compressed_vocab_size=390)
    _fails(broken, tmp_path / "out", "tokenizer.json", "391 distinct", "390")
    (broken / "tokenizer.json").unlink()
    _fails(broken, tmp_path / "out", "no tokenizer.json")


def test_cli_prints_the_error_and_exits_2(broken, tmp_path, capsys):
    _shard(broken, 0).unlink()
    assert main(["convert", "--hf-dir", str(broken), "--out", str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["convert", "--hf-dir", str(broken), "--out", str(tmp_path / "o"), "--mesh", "fsdp=two"]) == 2


def test_hf_style_aliases_convert_like_the_release(broken, tmp_path, tiny_converted):
    # spec model §2.6: `model.` prefix, self_attn, mlp, weight_scale_inv, e_score_correction_bias are accepted,
    # and per-stage DSpark embed/head copies are dropped; the result is the release's own conversion
    def alias(t):
        for name in list(t):
            new = ("model." + name).replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
            new = re.sub(r"gate\.bias$", "gate.e_score_correction_bias", new.replace(".scale", ".weight_scale_inv"))
            t[new] = t.pop(name)
        t["mtp.0.embed.weight"] = t["model.embed.weight"]

    _rewrite(broken, alias)
    out = convert(broken, tmp_path / "out", chunk_bytes=64 << 10, progress=False).out
    def files(root, name):  # zarr metadata and every chunk, byte for byte
        return {f.name: f.read_bytes() for f in (root / "params" / name).iterdir()}

    for name in ("layers.0.attn.wq_a.weight", "layers.2.ffn.experts.w1.weight", "layers.5.ffn.gate.bias",
                 "mtp.1.ffn.shared_experts.w2.weight", "vision.blocks.0.mlp.w1.weight"):
        assert files(out, name) == files(tiny_converted["fp32"], name), name
