"""Zero-copy safetensors reader and writer that knows every dtype of the V4.1 release.

The `safetensors` package's numpy backend cannot read `F8_E8M0` (numpy has no such dtype), so the
release's block scales are unreadable through it (spec model §2.1, notes/PLATFORM.md). The format is
simple enough to parse directly: an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the data
buffer; offsets are relative to the start of the buffer. Tensors are returned as read-only views of
an `np.memmap`, reinterpreted with `ml_dtypes` where numpy lacks the dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES",
    "SafetensorsError",
    "SafetensorsFile",
    "ShardedCheckpoint",
    "TensorInfo",
    "dtype_name",
    "save_file",
    "write_streamed",
]

# safetensors dtype string -> numpy dtype (explicitly little-endian: the format is little-endian).
# The release uses BF16, F32, F8_E4M3, F8_E8M0 and I8 (spec model §2.1); the rest cover the format.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES: dict[np.dtype, str] = {dt.newbyteorder("<"): name for name, dt in DTYPES.items()}
# The reference writer (the safetensors crate) lays tensors out by its Dtype enum, last variant first, then
# by name, and lists the header in that data order; writing the same keeps a re-written release shard
# byte-identical to the original.
_WRITE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
                "F32", "F64", "I64", "U64")

# The reference implementation refuses headers above 100 MB; a larger value means a corrupt file.
_MAX_HEADER = 100_000_000
_META = "__metadata__"


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed or inconsistent."""


class TensorInfo(NamedTuple):
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    nbytes: int


def dtype_name(dtype: Any) -> str:
    """The safetensors dtype string of a numpy / ml_dtypes dtype."""
    dt = np.dtype(dtype)
    key = dt.newbyteorder("<")
    if key not in _NAMES:
        raise SafetensorsError(f"dtype {dt} has no safetensors equivalent; known: {sorted(DTYPES)}")
    return _NAMES[key]


def _parse_header(path: Path, raw: bytes, data_size: int) -> tuple[dict, dict[str, tuple]]:
    """Validate the JSON header; return (metadata, {name: (dtype, shape, begin, end)})."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop(_META, None) or {}
    entries: dict[str, tuple] = {}
    for name, rec in header.items():
        where = f"{path}: tensor {name!r}"
        try:
            dtype, shape, (begin, end) = rec["dtype"], tuple(rec["shape"]), rec["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{where}: malformed header entry {rec!r}") from e
        if dtype not in DTYPES:
            raise SafetensorsError(f"{where}: unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: bad shape {list(shape)}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise SafetensorsError(f"{where}: bad data_offsets {[begin, end]}")
        if end > data_size:
            raise SafetensorsError(
                f"{where}: data_offsets {[begin, end]} run past the data buffer ({data_size} bytes);"
                " the file is truncated or corrupt (re-download it)"
            )
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise SafetensorsError(
                f"{where}: data_offsets span {end - begin} bytes but {dtype}{list(shape)} needs {nbytes}"
            )
        entries[name] = (dtype, shape, begin, end)
    _check_tiling(path, entries, data_size)
    return metadata, entries


def _check_tiling(path: Path, entries: dict[str, tuple], data_size: int) -> None:
    """The tensors' byte ranges must cover the data buffer exactly, in order, without gaps or overlaps (as the
    reference reader requires): shifted or overlapping offsets would otherwise read other tensors' bytes."""
    pos, prev = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != pos:
            what = f"overlaps {prev!r}" if begin < pos else f"leaves bytes [{pos}, {begin}) unused after " + (
                repr(prev) if prev else "the header")
            raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} {what}; the header does "
                                   "not describe the data (the file is corrupt: re-download it)")
        pos, prev = end, name
    if pos != data_size:
        raise SafetensorsError(f"{path}: the tensors end at byte {pos} of a {data_size}-byte data buffer; the file "
                               "has trailing bytes no tensor owns (corrupt: re-download it)")


class SafetensorsFile:
    """One safetensors file, memory-mapped; `get` returns zero-copy read-only views.

    Views stay valid after `close()` (they keep the mapping alive); `close` only drops this object's
    reference, so the OS unmaps the file once the last view is gone.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise SafetensorsError(
                        f"{self.path}: header length {n} does not fit in the file ({size} bytes);"
                        " the file is truncated or not safetensors"
                    )
                raw = f.read(n)
        except FileNotFoundError as e:
            raise SafetensorsError(f"{self.path}: no such file") from e
        self._data_start = 8 + n
        self.metadata, self._entries = _parse_header(self.path, raw, size - self._data_start)
        self._mmap: np.memmap | None = None
        self._closed = False

    def _buffer(self) -> np.ndarray:
        if self._mmap is None:
            if self._closed:
                raise SafetensorsError(f"{self.path}: read after close()")
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def info(self, name: str) -> TensorInfo:
        dtype, shape, begin, end = self._entry(name)
        return TensorInfo(dtype, shape, end - begin)

    def _entry(self, name: str) -> tuple:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of tensor `name` with its ml_dtypes/numpy dtype."""
        dtype, shape, begin, end = self._entry(name)
        start = self._data_start
        raw = self._buffer()[start + begin : start + end]
        # np.ndarray (not memmap subclass) view: slicing a memmap subclass is needlessly slow.
        return np.asarray(raw).view(DTYPES[dtype]).reshape(shape)

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of tensor `name` (its leading axis) as a new array, read with pread.

        Unlike `get`, nothing stays mapped: a streaming reader's resident memory is only what it holds.
        """
        dtype, shape, begin, _ = self._entry(name)
        dt = DTYPES[dtype]
        if not shape:
            start, stop, row = 0, 1, dt.itemsize
        else:
            stop = shape[0] if stop is None else min(stop, shape[0])
            row = math.prod(shape[1:]) * dt.itemsize
        out = np.empty((max(stop - start, 0), *shape[1:]), dt)
        raw = out.reshape(-1).view(np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [raw], self._data_start + begin + start * row) if raw.size else 0
        finally:
            os.close(fd)
        if got != raw.size:
            raise SafetensorsError(f"{self.path}: tensor {name!r}: short read ({got} of {raw.size} bytes);"
                                   " the file changed or is truncated")
        return out.reshape(shape) if not shape else out

    def close(self) -> None:
        self._mmap, self._closed = None, True

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


def _header_bytes(layout: dict[str, dict], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise SafetensorsError(f"metadata must map str to str; offending entries: {bad}")
        header[_META] = dict(metadata)
    for name in sorted(layout, key=lambda n: layout[n]["data_offsets"]):  # data order, as the reference writes
        header[name] = layout[name]
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # The format pads the header with spaces so the data buffer starts 8-byte aligned.
    return raw + b" " * (-len(raw) % 8)


def save_file(tensors: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` as one safetensors file, atomically (temp file in the same dir + os.replace).

    As the reference writer does: the data buffer is laid out by dtype (``_WRITE_ORDER``, widest first), then
    name, so every tensor is naturally aligned and there are no holes; the header lists the tensors in that
    order. A release shard read and written back is byte-identical.
    """
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        a = np.asarray(t)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        # not np.ascontiguousarray: it turns 0-d scalars into shape (1,)
        arrays[name] = a if a.flags.c_contiguous else a.copy(order="C")
    specs = {}
    for name, a in arrays.items():
        try:
            specs[name] = (dtype_name(a.dtype), a.shape)
        except SafetensorsError as e:
            raise SafetensorsError(f"{path}: tensor {name!r}: {e}") from None
    write_streamed(path, specs, lambda name: iter((arrays[name],)), metadata)


def write_streamed(path: str | os.PathLike, specs: Mapping[str, tuple[str, tuple[int, ...]]],
                   produce: Callable[[str], Iterable[np.ndarray]], metadata: Mapping[str, str] | None = None
                   ) -> None:
    """Write one safetensors file laid out as :func:`save_file` lays it out, with each tensor's data coming in
    bands: ``specs`` is ``{name: (dtype string, shape)}``; ``produce(name)`` yields consecutive leading-axis
    bands of that tensor, so only one band is in memory at a time. Atomic like ``save_file``.
    """
    path = Path(path)
    for name in specs:
        if not isinstance(name, str) or name == _META:
            raise SafetensorsError(f"{path}: invalid tensor name {name!r}")
    order = sorted(specs, key=lambda k: (-_WRITE_ORDER.index(specs[k][0]), k))
    layout, offset = {}, 0
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        layout[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = _header_bytes(layout, metadata)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name in order:
                _write_bands(f, path, name, specs[name], produce(name), layout[name]["data_offsets"])
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_bands(f, path: Path, name: str, spec: tuple[str, tuple[int, ...]], bands: Iterable[np.ndarray],
                 span: list[int]) -> None:
    dtype = DTYPES[spec[0]]
    written = 0
    for band in bands:
        a = np.asarray(band)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # not ascontiguousarray: 0-d stays 0-d
        if a.dtype.newbyteorder("<") != dtype.newbyteorder("<") or a.shape[1:] != tuple(spec[1][1:]):
            raise SafetensorsError(f"{path}: tensor {name!r}: a band of {a.dtype}{list(a.shape)} does not fit "
                                   f"{spec[0]}{list(spec[1])}")
        if a.nbytes:
            f.write(memoryview(a.astype(dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)))
        written += a.nbytes
    if written != span[1] - span[0]:
        raise SafetensorsError(f"{path}: tensor {name!r}: {written} bytes were produced for {span[1] - span[0]}")


class ShardedCheckpoint:
    """The tensors of an HF checkpoint directory, through `model.safetensors.index.json`.

    A directory with a single `model.safetensors` and no index is accepted too. Shards are opened
    lazily (header parse + memmap) and cached.
    """

    INDEX = "model.safetensors.index.json"

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / self.INDEX
        if index.is_file():
            try:
                spec = json.loads(index.read_text())
                weight_map = spec["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index}: not a valid index (needs a 'weight_map'): {e}") from e
            self.metadata: dict = spec.get("metadata") or {}
            self._weight_map: dict[str, str] = dict(weight_map)
        elif (self.dir / "model.safetensors").is_file():
            self.metadata = {}
            single = SafetensorsFile(self.dir / "model.safetensors")
            self._weight_map = {k: "model.safetensors" for k in single.keys()}
        else:
            raise SafetensorsError(f"{self.dir}: neither {self.INDEX} nor model.safetensors found")
        self._files: dict[str, SafetensorsFile] = {}

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def shards(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    def shard_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"{self.dir}: {name!r} is not in {self.INDEX}") from None

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            path = self.dir / shard
            if not path.is_file():
                raise SafetensorsError(f"{self.dir}: shard {shard!r} listed in the index is missing")
            self._files[shard] = SafetensorsFile(path)
        return self._files[shard]

    def _locate(self, name: str) -> SafetensorsFile:
        f = self._file(self.shard_of(name))
        if name not in f:
            raise SafetensorsError(f"{f.path}: tensor {name!r} is listed in {self.INDEX} but missing from this shard")
        return f

    def info(self, name: str) -> TensorInfo:
        return self._locate(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._locate(name).get(name)

    def read_rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._locate(name).read_rows(name, start, stop)

    def validate(self) -> None:
        """Check index <-> shard headers both ways (headers only, no data is read)."""
        for shard in self.shards():
            f = self._file(shard)
            listed = {k for k, v in self._weight_map.items() if v == shard}
            missing, extra = sorted(listed - set(f.keys())), sorted(set(f.keys()) - listed)
            if missing:
                raise SafetensorsError(
                    f"{f.path}: {len(missing)} tensor(s) listed in {self.INDEX} are missing from"
                    f" this shard, e.g. {missing[:5]}"
                )
            if extra:
                raise SafetensorsError(
                    f"{f.path}: {len(extra)} tensor(s) in this shard are not in {self.INDEX}"
                    f" (or are mapped to another shard), e.g. {extra[:5]}"
                )

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedCheckpoint({str(self.dir)!r}, {len(self)} tensors, {len(self.shards())} shards)"
