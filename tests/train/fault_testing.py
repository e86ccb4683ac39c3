"""Helpers of the fault tests: a read-only directory and a small disk, real where the platform allows.

Without root, ``chmod`` makes a directory read-only; as root (which ignores modes) a read-only tmpfs is mounted
instead, and a small disk is a size-limited tmpfs. Where mounting is refused, the caller is told (``None``) or
the test is skipped.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path

import pytest


def _mount(path: Path, options: str) -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return out.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_directory(path: Path):
    """``path`` created and read-only for this process while the context lasts."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            yield path
        finally:
            path.chmod(stat.S_IRWXU)
        return
    if not _mount(path, "ro,size=64k"):
        pytest.skip("running as root without permission to mount a read-only tmpfs")
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int):
    """A tmpfs of ``size_mb`` MiB at ``path`` (yields True), or a plain directory where mounting is not allowed
    (yields False: the caller simulates the full disk some other way)."""
    path.mkdir(parents=True)
    mounted = _mount(path, f"size={size_mb}m")
    try:
        yield mounted
    finally:
        if mounted:
            _umount(path)


def fill(path: Path, leave: int = 0) -> None:
    """Write a file into ``path``'s filesystem until at most ``leave`` bytes are free there."""
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(path / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(free - leave, 0))
            f.flush()
