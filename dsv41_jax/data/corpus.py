"""Text documents for pre-training: files on disk (plain text, jsonl) or the embedded default corpus.

The embedded corpus is the Python standard library's own ``.py`` files: present on every machine with this
package installed, so a fresh machine trains with no network (issue: pretraining, "embedded default
corpus"). Order is the sorted relative path, so every host and every run sees the same documents.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

from dsv41_jax.config import ConfigError


def embedded_files(limit: int) -> list[Path]:
    """Sorted ``.py`` files of the standard library (tests and site-packages excluded), at most ``limit``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & set(skip))
    return files[:limit]


def _expand(paths: tuple[str, ...]) -> list[Path]:
    out: list[Path] = []
    for pattern in paths:
        hits = sorted(glob.glob(pattern, recursive=True))
        if not hits:
            raise ConfigError(f"data.paths: {pattern!r} matches no file")
        out += [Path(h) for h in hits]
    return out


def read_documents(source: str, paths: tuple[str, ...] = (), limit: int = 2000, jsonl_key: str = "text",
                   ) -> list[str]:
    """Up to ``limit`` non-empty documents, in a deterministic order."""
    docs: list[str] = []
    if source == "embedded":
        files = embedded_files(limit)
    elif source in ("text", "jsonl"):
        files = _expand(paths)
    else:
        raise ConfigError(f"data.source must be embedded, text or jsonl, got {source!r}")
    for path in files:
        if len(docs) >= limit:
            break
        if source == "jsonl":
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[jsonl_key]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ConfigError(f"{path}:{n + 1}: expected a JSON object with key {jsonl_key!r}: {err}") from err
                if text:
                    docs.append(str(text))
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                docs.append(text)
    return docs[:limit]
