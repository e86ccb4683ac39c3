"""Repository invariants the test runner relies on."""

from __future__ import annotations

import collections
from pathlib import Path


def test_test_module_basenames_are_unique():
    """tests/ holds no packages, so pytest imports every test module by its basename: two files of one name
    in different folders fail collection (``import file mismatch``) whenever both are collected."""
    counts = collections.Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [name for name, n in counts.items() if n > 1], counts.most_common(3)
