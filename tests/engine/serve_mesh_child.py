"""The multi-device half of ``test_serve_mesh.py`` (run with 8 fake CPU devices): ``dsv41 score`` and ``dsv41
eval-served`` of one converted checkpoint with and without ``--mesh``, and how the mesh restore placed the experts;
one JSON line."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from dsv41_jax import config as C
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.fake_hf import write_fake_hf
from dsv41_jax.cli import main
from dsv41_jax.engine.mesh import load_for_serving

# two layers (a ratio-2 and a ratio-1 index source, Engram at 0): the smallest programs to compile
MODEL = {"preset": "tiny", "dtype": "float32", "n_layers": 2,
         "attention": {"compress_ratios": [2, 1, 0, 0, 0], "kv_source_layers": [0, 1], "index_source_layers": [0, 1],
                       "candidate_source_layer": 1},
         "engram": {"layer_ids": [0], "num_embeddings": [434]}, "dspark": {"target_layer_ids": [0, 1, 1]}}


def eval_served(root: Path, ckpt: Path) -> dict:
    """``dsv41 eval-served`` on one device and on ``--mesh data=2,expert=4``: its table rows, each way."""
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(40)]
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(8):
            pair = {"prompt": " ".join(rng.choice(words, 6)), "response": " ".join(rng.choice(words, 3))}
            f.write(json.dumps(pair) + "\n")
    rows = {}
    for tag, mesh in (("one", []), ("eight", ["--mesh", "data=2,expert=4"])):
        assert main(["eval-served", "--ckpt", str(ckpt), "--data", str(root / "pairs.jsonl"), "--boundaries",
                     "cold,12", "--max-len", "48", "--out", str(root / f"{tag}.jsonl"), *mesh]) == 0
        rows[tag] = [json.loads(line) for line in (root / f"{tag}.jsonl").read_text().splitlines()]
    return rows


def main_child(root: Path) -> dict:
    write_fake_hf(C.from_dict(MODEL), root / "hf", seed=2, shard_bytes=1 << 20)
    ckpt = convert(root / "hf", root / "ckpt", progress=False).out  # native
    np.save(root / "ids.npy", np.random.default_rng(0).integers(4, 512, (8, 40)))
    logits = {}
    for tag, mesh in (("one", []), ("eight", ["--mesh", "expert=8"])):
        assert main(["score", "--ckpt", str(ckpt), "--ids", str(root / "ids.npy"), "--out", str(root / f"{tag}.npy"),
                     "--param-dtype", "float32", *mesh]) == 0
        logits[tag] = np.load(root / f"{tag}.npy")
    loaded, mesh = load_for_serving("expert=8", ckpt=ckpt)
    w1 = loaded.model.layers[0].ffn.experts.w1.weight[...]
    err = np.abs(logits["eight"] - logits["one"]).max() / np.abs(logits["one"]).max()
    same = bool((logits["eight"].argmax(-1) == logits["one"].argmax(-1)).all())
    return {"eval_served": eval_served(root, ckpt), "logits_rel_err": float(err), "argmax_same": same,
            "expert_shards": len({str(s.index) for s in w1.addressable_shards}), "mesh": dict(mesh.shape)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        report = main_child(Path(d))
    sys.stdout.write(json.dumps(report) + "\n")
