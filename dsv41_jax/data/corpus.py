"""Text documents for pre-training: files on disk (plain text, jsonl, parquet, ArrayRecord) or the embedded
default corpus.

The embedded corpus is the Python standard library's own ``.py`` files: present on every machine with this
package installed, so a fresh machine trains with no network (issue: pretraining, "embedded default
corpus"). Order is the sorted relative path, so every host and every run sees the same documents.

Text and jsonl files are read whole (empty documents dropped). Parquet and ArrayRecord files are opened
lazily: :func:`open_documents` reads only their metadata and returns a random-access sequence whose item ``i``
is read when asked for (parquet through its row group, a few kept in a small cache; ArrayRecord one record).
Documents of these two formats are taken as they are: an empty one stays (it packs to ``[BOS, EOS]``).
Both need the ``data`` extra (``pip install -e ".[data]"``: pyarrow, array_record).

``data.paths`` may name remote files by URI (``gs://bucket/corpus/*.jsonl``, ``s3://``, anything
``etils.epath`` opens, with its file-system package installed, e.g. ``gcsfs``): text, jsonl and parquet are
read through ``epath``; patterns there take ``*``, ``?`` and ``[...]`` but not ``**`` (a recursive listing of
a bucket is one request per directory). ArrayRecord files are opened by array_record's reader, which takes
local paths.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import json
import os
import sysconfig
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

from dsv41_jax.config import ConfigError


def embedded_files(limit: int | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (tests and site-packages excluded), at most ``limit``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & set(skip))
    return files[:limit]


def is_uri(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a remote file (``scheme://...``) rather than a local one."""
    return "://" in str(path)


def expand_paths(paths: tuple[str, ...]) -> list:
    """The files each pattern matches, sorted per pattern: ``pathlib.Path`` for local ones, ``epath.Path``
    for URIs."""
    out: list = []
    for pattern in paths:
        local = not is_uri(pattern)
        hits = [Path(h) for h in sorted(glob.glob(pattern, recursive=True))] if local else _expand_uri(pattern)
        if not hits:
            raise ConfigError(f"data.paths: {pattern!r} matches no file")
        out += hits
    return out


def _expand_uri(pattern: str) -> list:
    from etils import epath

    scheme, rest = pattern.split("://", 1)
    parts = rest.split("/")
    wild = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
    try:
        if wild is None:
            path = epath.Path(pattern)
            return [path] if path.is_file() else []
        if "**" in parts[wild:]:
            raise ConfigError(f"data.paths: {pattern!r}: '**' is not supported in remote paths (one listing "
                              "request per directory); name each directory, e.g. .../*/*.jsonl")
        root = epath.Path(f"{scheme}://" + "/".join(parts[:wild]))
        return sorted((p for p in root.glob("/".join(parts[wild:])) if p.is_file()), key=str)
    except ConfigError:
        raise
    except Exception as err:  # no file-system package for the scheme, credentials, network: say which pattern
        raise ConfigError(f"data.paths: cannot list {pattern!r}: {type(err).__name__}: {err}") from err


def read_documents(source: str, paths: tuple[str, ...] = (), limit: int | None = None, jsonl_key: str = "text",
                   ) -> list[str]:
    """Up to ``limit`` (None: every) non-empty documents, in a deterministic order."""
    docs: list[str] = []
    if source == "embedded":
        files = embedded_files(limit)
    elif source in ("text", "jsonl"):
        files = expand_paths(paths)
    else:
        raise ConfigError(f"data.source must be embedded, text or jsonl here (open_documents reads the others), "
                          f"got {source!r}")
    for path in files:
        if limit is not None and len(docs) >= limit:
            break
        try:
            raw = path.read_text(encoding="utf-8", errors="replace") if source == "embedded" else \
                _decode(path, path.read_bytes(), strict=source == "jsonl")
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from err
        if source == "jsonl":
            for n, line in enumerate(raw.splitlines()):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[jsonl_key]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ConfigError(f"{path}:{n + 1}: expected a JSON object with key {jsonl_key!r}: {err}") from err
                if text:
                    docs.append(str(text))
        elif raw.strip():
            docs.append(raw)
    return docs[:limit]


def _decode(path: Path, raw: bytes, strict: bool) -> str:
    """UTF-8 text of a corpus file; a binary file (NUL bytes, or over 2% undecodable bytes) is an error rather
    than documents of replacement characters. ``strict`` (jsonl): any undecodable byte is an error."""
    if b"\0" in raw[:65536]:
        raise ConfigError(f"{path}: a binary file (it holds NUL bytes), not UTF-8 text; check data.paths")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        first = err.start
        if strict:
            raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {first})") from err
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > 0.02 * len(text):
        raise ConfigError(f"{path}: {bad} of {len(text)} characters are not UTF-8 (the first at byte {first}): a "
                          "binary file or another encoding; data.source text reads UTF-8 text files")
    return text


def _need(module: str, source: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"data.source {source} needs {module.split('.')[0]}: pip install -e \".[data]\" "
                          f"({err})") from err


class CorpusCapped(UserWarning):
    """``data.max_documents`` left documents of the corpus out."""


class _LazyDocuments(Sequence):
    """Random access by index (negative indices and slices too); subclasses read one document: ``_get``, and
    set ``length`` (the documents offered) and ``total`` (those in the files)."""

    length: int
    total: int

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} of {len(self)}")
        return self._get(i % len(self))


class ParquetDocuments(_LazyDocuments):
    """The string column ``column`` of parquet ``files``, row by row, read lazily.

    Opening reads each file's footer only (row counts, schema). Row ``i`` is read through its row group; the
    last ``cache`` row groups stay in memory, so sequential reads cost one read per row group and a shuffled
    read one per miss (keep row groups small in training files). Thread-safe; picklable (handles reopen).
    """

    def __init__(self, files: Sequence[Path], column: str, limit: int | None = None, cache: int = 4):
        _need("pyarrow.parquet", "parquet")
        self.files, self.column, self.cache = list(files), column, cache
        self.groups: list[tuple[int, int, int]] = []  # (file, row group, first row), in row order
        total = 0
        for n, path in enumerate(self.files):
            try:
                meta = _parquet_file(path)
            except Exception as err:  # OSError, ArrowInvalid, ...: the file is what matters to the reader
                raise ConfigError(f"{path}: cannot read as parquet: {err}") from err
            names = meta.schema_arrow.names
            if column not in names:
                raise ConfigError(f"{path}: no column {column!r} (data.parquet_column); columns: {', '.join(names)}")
            kind = meta.schema_arrow.field(column).type
            if str(kind) not in ("string", "large_string", "string_view"):
                raise ConfigError(f"{path}: column {column!r} holds {kind}, not strings")
            for g in range(meta.metadata.num_row_groups):
                self.groups.append((n, g, total))
                total += meta.metadata.row_group(g).num_rows
        self.total = total
        self.length = total if limit is None else min(total, limit)
        self._starts = [g[2] for g in self.groups]
        self._init_cache()

    def _init_cache(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, object] = {}
        self._groups: collections.OrderedDict[int, list] = collections.OrderedDict()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_handles", "_groups")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_cache()

    def __len__(self) -> int:
        return self.length

    def _rows(self, g: int) -> list:
        with self._lock:
            if g in self._groups:
                self._groups.move_to_end(g)
                return self._groups[g]
            f, rg, _ = self.groups[g]
            if f not in self._handles:
                self._handles[f] = _parquet_file(self.files[f])
            try:
                rows = self._handles[f].read_row_group(rg, columns=[self.column]).column(0).to_pylist()
            except Exception as err:
                raise ConfigError(f"{self.files[f]}: cannot read row group {rg}: {err}") from err
            self._groups[g] = rows
            if len(self._groups) > self.cache:
                self._groups.popitem(last=False)
            return rows

    def _get(self, i: int) -> str:
        g = bisect.bisect_right(self._starts, i) - 1
        return self._rows(g)[i - self._starts[g]] or ""


def _parquet_file(path):
    """pyarrow's reader over a local path, or over an ``epath`` file object for a URI."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path.open("rb") if is_uri(path) else path)


@dataclasses.dataclass(frozen=True)
class _Part:  # array_record's FileInstruction: a whole file, its record count known
    filename: str
    skip: int
    take: int
    examples_in_shard: int


class ArrayRecordDocuments(_LazyDocuments):
    """Records of ArrayRecord ``files`` as documents: each record is one document's UTF-8 text (undecodable
    bytes become U+FFFD). Opening reads each file's record count; records are read one at a time on demand
    (grain's ``ArrayRecordDataSource``)."""

    def __init__(self, files: Sequence[Path], limit: int | None = None):
        module = _need("array_record.python.array_record_module", "arrayrecord")
        from grain.sources import ArrayRecordDataSource

        parts = []
        for path in files:
            if is_uri(path):
                raise ConfigError(f"{path}: ArrayRecord files are opened by array_record's reader, which takes local "
                                  "paths: copy them to local disk, or use jsonl or parquet for remote corpora")
            try:
                reader = module.ArrayRecordReader(str(path))
                n = reader.num_records()
                reader.close()
            except Exception as err:
                raise ConfigError(f"{path}: cannot read as ArrayRecord: {err}") from err
            parts.append(_Part(str(path), 0, n, n))
        self.source = ArrayRecordDataSource(parts)
        self.total = len(self.source)
        self.length = self.total if limit is None else min(self.total, limit)

    def __len__(self) -> int:
        return self.length

    def _get(self, i: int) -> str:
        return self.source[i].decode("utf-8", errors="replace")


def open_documents(source: str, paths: tuple[str, ...] = (), limit: int | None = None, *, jsonl_key: str = "text",
                   parquet_column: str = "text") -> Sequence[str]:
    """The documents of ``source`` as a random-access sequence of at most ``limit`` (None: all) strings.

    ``embedded``, ``text`` and ``jsonl`` are read into a list (:func:`read_documents`); ``parquet`` and
    ``arrayrecord`` stay on disk (:class:`ParquetDocuments`, :class:`ArrayRecordDocuments`). A pattern that
    matches nothing, or a file that cannot be read, is a :class:`ConfigError` naming it. A ``limit`` that
    leaves documents out is a :class:`CorpusCapped` warning naming ``data.max_documents``: a cap set for a
    smoke test must not quietly train a real run on a sliver of its corpus.
    """
    if source == "parquet":
        docs = ParquetDocuments(expand_paths(paths), parquet_column, limit)
    elif source == "arrayrecord":
        docs = ArrayRecordDocuments(expand_paths(paths), limit)
    else:  # one document past the cap tells whether it left any out
        docs = read_documents(source, paths, None if limit is None else limit + 1, jsonl_key)
    total = docs.total if isinstance(docs, _LazyDocuments) else len(docs)
    if limit is not None and total > limit:
        more = f"{total - limit:,} of {total:,}" if isinstance(docs, _LazyDocuments) else "more"
        warnings.warn(f"data.max_documents = {limit:,} caps the corpus: {more} documents of data.source {source} "
                      "are left out; set data.max_documents: null to train on all of them", CorpusCapped,
                      stacklevel=2)
        docs = docs[:limit] if isinstance(docs, list) else docs
    if len(docs) == 0:
        what = {"jsonl": f"no line with a non-empty {jsonl_key!r} (data.jsonl_key)", "parquet": "no rows",
                "arrayrecord": "no records"}.get(source, "only empty files")
        raise ConfigError(f"data.paths {list(paths)}: the corpus is empty ({what}); nothing to train on")
    return docs
