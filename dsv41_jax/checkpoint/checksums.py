"""CRC-32 of every file of a finished checkpoint directory, stored beside it and verified before a restore.

Orbax and tensorstore keep no checksums of the bytes they write, so a file corrupted in place (same size, other
bytes) restores without complaint into wrong weights. :func:`write` records ``{relative path: [size, crc32]}``
in ``<dir>/checksums.json`` once the directory is complete; :func:`verify` reads every listed file again and
names the first that differs. Cost: one sequential read of the directory per write and per verify (zlib's
CRC-32 runs at several GB/s; the files were just written, so the first read usually comes from the page cache).
A directory without ``checksums.json`` (written before this existed, or by a run killed between the save and
the manifest) is not verified.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

NAME = "checksums.json"
_BLOCK = 8 << 20


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


def compute(directory: Path) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` of every file under ``directory`` (the manifest itself excluded)."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != NAME)
    return {str(p.relative_to(directory)): [p.stat().st_size, crc32(p)] for p in files}


def write(directory: Path) -> None:
    """Record the checksums of ``directory``'s files (atomically: a torn manifest is never read)."""
    directory = Path(directory)
    tmp = directory / f"{NAME}.tmp"
    tmp.write_text(json.dumps({"crc32": compute(directory)}, indent=0) + "\n")
    os.replace(tmp, directory / NAME)


def verify(directory: Path) -> str | None:
    """None when ``directory`` matches its manifest (or has none); else what differs, in a few words."""
    directory = Path(directory)
    path = directory / NAME
    if not path.is_file():
        return None
    try:
        listed = json.loads(path.read_text())["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{path} does not read ({err})"
    for rel, (size, value) in listed.items():
        file = directory / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, {size} were written"
        if crc32(file) != value:
            return f"{rel} does not match the checksum written with it (its bytes changed on disk)"
    return None
