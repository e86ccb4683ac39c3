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
