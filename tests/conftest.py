"""Shared fixtures: the tiny config (every layer role of the release) and the golden reference data."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from dsv41_jax import config as C

REPO = Path(__file__).resolve().parents[1]
from dsv41_jax.testing import GOLDEN  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run this test on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cfg() -> C.ModelConfig:
    """The tiny preset in fp32 activations (the test precision mode)."""
    return C.tiny().replace(dtype="float32")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "tiny_hf" / "config.json").exists():
        pytest.skip(f"golden reference data not found at {GOLDEN} (set DSV41_GOLDEN)")
    return GOLDEN


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
