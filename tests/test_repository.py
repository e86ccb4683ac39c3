"""Repository invariants the test runner relies on."""

from __future__ import annotations

import collections
from pathlib import Path


def test_test_module_basenames_are_unique():
    """tests/ holds no packages, so pytest imports every test module by its basename: two files of one name
    in different folders fail collection (``import file mismatch``) whenever both are collected."""
    counts = collections.Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [name for name, n in counts.items() if n > 1], counts.most_common(3)


def test_every_gpu_test_file_is_in_a_readme_group():
    """The README runs the ``gpu``-marked tests as a few pytest commands on a GPU machine: a file that holds
    such tests and is in none of them would never run anywhere."""
    import re

    root = Path(__file__).resolve().parents[1]
    marked = {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
              if re.search(r"^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*\bgpu\b)", p.read_text(), re.M)}
    readme = (root / "README.md").read_text().replace("\\\n", " ")
    commands = [line for line in readme.splitlines() if line.startswith("python -m pytest") and "-m gpu" in line]
    grouped = {word for line in commands for word in line.split() if word.startswith("tests/")}
    assert marked, "no gpu-marked test found: the pattern above no longer matches the markers"
    assert not marked - grouped, f"gpu tests in no README group: {sorted(marked - grouped)}"
    assert not grouped - marked, f"README groups name files without gpu tests: {sorted(grouped - marked)}"
