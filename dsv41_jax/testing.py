"""Locations of the test data shipped with the repository (golden reference outputs, release configs)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

_DATA = Path(__file__).resolve().parents[1] / "tests" / "data"

# the official reference implementation's outputs on a tiny release-format checkpoint
GOLDEN = Path(os.environ.get("DSV41_GOLDEN", _DATA / "golden"))
# the released config.json and inference/config.json, byte for byte
RELEASE = _DATA / "release"

# tests whose bounds are calibrated on XLA:CPU (bit-level or ~1e-6 agreement between two programs)
CPU_EXACT = pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
    "bit-level and ~1e-6 comparisons are calibrated on XLA:CPU; XLA:GPU accumulates in another order and "
    "flips more QDQ-boundary values, so there the golden robust recipe of tests/test_gpu.py applies"))
