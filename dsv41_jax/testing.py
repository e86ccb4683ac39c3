"""Locations of the test data shipped with the repository (golden reference outputs, release configs)."""

from __future__ import annotations

import os
from pathlib import Path

_DATA = Path(__file__).resolve().parents[1] / "tests" / "data"

# the official reference implementation's outputs on a tiny release-format checkpoint
GOLDEN = Path(os.environ.get("DSV41_GOLDEN", _DATA / "golden"))
# the released config.json and inference/config.json, byte for byte
RELEASE = _DATA / "release"
