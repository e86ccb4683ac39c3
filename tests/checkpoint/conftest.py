"""Checkpoints shared by the converter tests: a random tiny model in the release format, and its conversions."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.fake_hf import write_fake_hf
from dsv41_jax.checkpoint.tree import flat_variables
from dsv41_jax.model.transformer import Transformer


@pytest.fixture(scope="session")
def tiny_params() -> dict[str, np.ndarray]:
    """A randomly initialised tiny Transformer's parameters (float32, our names)."""
    model = Transformer(C.tiny(), rngs=nnx.Rngs(7))
    return {n: np.asarray(v[...]) for n, v in flat_variables(model).items()}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, tiny_params):
    """That model written in the release format by make-fake-hf (DSpark / vision tensors random), 3 shards+."""
    path = tmp_path_factory.mktemp("tiny_hf")
    write_fake_hf(C.tiny(), path, seed=3, params=tiny_params, shard_bytes=1 << 20)
    return path


@pytest.fixture(scope="session")
def tiny_converted(tmp_path_factory, tiny_hf):
    """``tiny_hf`` converted in every weights mode: {mode: directory}."""
    root = tmp_path_factory.mktemp("converted")
    return {mode: convert(tiny_hf, root / mode, weights=mode, chunk_bytes=64 << 10, progress=False).out
            for mode in ("fp32", "bf16", "native")}


@pytest.fixture(scope="session")
def golden_native(tmp_path_factory, golden_dir):
    """The golden checkpoint through `dsv41 convert` with its default weights mode (native)."""
    from dsv41_jax.cli import main

    out = tmp_path_factory.mktemp("golden_native") / "ckpt"
    assert main(["convert", "--hf-dir", str(golden_dir / "tiny_hf"), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def golden_bf16(tmp_path_factory, golden_native):
    """That conversion through `dsv41 export --weights bf16`: the golden in Hugging Face's dequantised form."""
    from dsv41_jax.cli import main

    out = tmp_path_factory.mktemp("golden_bf16") / "hf"
    assert main(["export", "--ckpt", str(golden_native), "--out", str(out), "--weights", "bf16", "--quiet"]) == 0
    return out
