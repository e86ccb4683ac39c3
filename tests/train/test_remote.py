"""``dsv41_jax.train.remote`` on ``gs://`` paths served from a local directory (``gcs_bucket``): what a
fine-tuning run's ``posttrain.init_from`` at a URI resolves to, and what is refused. The training loop's and
the converter's own URI runs are in ``test_loop.py`` and ``tests/checkpoint/test_export.py``."""

from __future__ import annotations

import json

import pytest

from dsv41_jax.checkpoint.convert import MANIFEST
from dsv41_jax.config import ConfigError
from dsv41_jax.train import remote


def _write(root, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def test_init_from_a_uri_is_a_run_or_a_converted_checkpoint(gcs_bucket, tmp_path, monkeypatch):
    uri, bucket = gcs_bucket
    monkeypatch.setenv("DSV41_RUN_MIRROR", str(tmp_path / "mirror"))
    run = {"tokenizer.json": b"{}", "metrics.jsonl": b'{"step": 3}\n', "checkpoints/3/state/a": b"\x01" * 100,
           f"checkpoints/3/{remote.MARK}": b"3\n", "checkpoints/4/state/a": b"\x02" * 100}  # 4: cut off
    ckpt = {"config.json": b"{}", "params/x/0": b"\x03" * 50, MANIFEST: json.dumps({"format": "x"}).encode()}
    _write(bucket / "run", run)
    _write(bucket / "ckpt", ckpt)
    logs = []

    local = remote.local_source(f"{uri}/run", "posttrain.init_from", logs.append)
    assert local == tmp_path / "mirror" / "gs" / "bucket" / "run"
    assert (local / "checkpoints" / "3" / "state" / "a").read_bytes() == run["checkpoints/3/state/a"]
    assert not (local / "checkpoints" / "4").exists() and (local / "tokenizer.json").is_file()
    assert any("never finished" in m for m in logs), logs

    local = remote.local_source(f"{uri}/ckpt", "posttrain.init_from", logs.append)
    got = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert got == ckpt
    (bucket / "ckpt" / "params" / "x" / "0").write_bytes(b"changed")  # the manifest is the same: the mirror loads
    assert remote.local_source(f"{uri}/ckpt", "w", logs.append) == local
    assert (local / "params" / "x" / "0").read_bytes() == ckpt["params/x/0"]
    (bucket / "ckpt" / MANIFEST).write_text(json.dumps({"format": "y"}))  # re-written there: copied again
    assert remote.local_source(f"{uri}/ckpt", "w", logs.append) == local
    assert (local / "params" / "x" / "0").read_bytes() == b"changed" and any("changed since" in m for m in logs)

    (bucket / "half").mkdir()
    (bucket / "half" / "config.json").write_bytes(b"{}")  # an upload cut off before its manifest
    with pytest.raises(ConfigError, match=r"posttrain\.init_from gs://bucket/half: no dsv41_checkpoint\.json there"):
        remote.local_source(f"{uri}/half", "posttrain.init_from", logs.append)
    assert not (tmp_path / "mirror" / "gs" / "bucket" / "half").exists()
    assert remote.local_source(tmp_path / "plain", "x") == tmp_path / "plain"  # a local path stays itself


def test_publish_writes_every_file_and_the_marker_last(gcs_bucket, tmp_path, monkeypatch):
    uri, bucket = gcs_bucket
    src = tmp_path / "out"
    files = {"a/b": b"1" * 10, "c": b"2", "index.json": b"{}"}
    _write(src, files)
    order = []
    real = remote._copy
    monkeypatch.setattr(remote, "_copy", lambda s, d: (order.append(str(d)), real(s, d)))
    remote.publish(src, f"{uri}/out", "index.json", lambda _: None)
    assert order[-1].endswith("/out/index.json") and len(order) == 3
    assert {str(p.relative_to(bucket / "out")): p.read_bytes() for p in (bucket / "out").rglob("*")
            if p.is_file()} == files
    assert remote.remote_state(f"{uri}/out", "index.json", "--out") == "finished"
    assert remote.remote_state(f"{uri}/nothing", "index.json", "--out") == "empty"


def test_a_drafter_npz_loads_from_a_uri(gcs_bucket, tmp_path):
    """``--drafter`` / ``posttrain.drafter.init_from`` at a URI: the npz is read through ``etils.epath``."""
    import numpy as np
    from flax import nnx

    from dsv41_jax import config as C
    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.model.dspark import DSpark
    from dsv41_jax.train.dspark import load_drafter_npz, save_drafter

    uri, bucket = gcs_bucket
    cfg = C.tiny()
    bucket.mkdir(parents=True, exist_ok=True)
    save_drafter(DSpark(cfg, rngs=nnx.Rngs(5)), bucket / "drafter.npz")
    got = flat_variables(load_drafter_npz(f"{uri}/drafter.npz", cfg))
    want = flat_variables(load_drafter_npz(bucket / "drafter.npz", cfg))
    fresh = flat_variables(DSpark(cfg, rngs=nnx.Rngs(0)))  # what loading overwrites
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name][...]), np.asarray(want[name][...]), err_msg=name)
    assert any(not np.array_equal(np.asarray(got[n][...]), np.asarray(fresh[n][...])) for n in want)


def test_a_tokenizer_at_a_uri_is_copied_into_the_run(gcs_bucket, tmp_path, golden_dir):
    """``data.tokenizer: gs://...``: the run directory gets the file (the run and its mirror hold what it trained
    with) and its Engram token map is the file's; a missing one is named."""
    import shutil

    import numpy as np

    from dsv41_jax import config as C
    from dsv41_jax.data.tokenizer import load_or_train
    from dsv41_jax.engram_hash import build_token_map

    uri, bucket = gcs_bucket
    bucket.mkdir(parents=True, exist_ok=True)
    src = golden_dir / "tiny_hf" / "tokenizer.json"
    shutil.copy(src, bucket / "tok.json")
    cfg = C.from_hf(golden_dir / "tiny_hf")
    path, token_map = load_or_train(f"{uri}/tok.json", tmp_path / "run" / "tokenizer.json", cfg, [])
    assert path == tmp_path / "run" / "tokenizer.json" and path.read_bytes() == src.read_bytes()
    np.testing.assert_array_equal(token_map, build_token_map(src))
    assert load_or_train(f"{uri}/tok.json", path, cfg, [])[0] == path  # a resumed run: the same file
    (bucket / "tok.json").write_text("{}")  # changed at the URI: the run keeps what it trained with
    with pytest.raises(ConfigError, match=r"differs from the tokenizer this run was started with"):
        load_or_train(f"{uri}/tok.json", path, cfg, [])
    assert path.read_bytes() == src.read_bytes()
    with pytest.raises(ConfigError, match=r"data\.tokenizer: cannot read gs://bucket/none\.json"):
        load_or_train(f"{uri}/none.json", tmp_path / "run" / "tokenizer.json", cfg, [])
