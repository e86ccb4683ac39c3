"""The prefix cache's host and disk tiers, and the pool of SWA rings (spec attention §9.4, §9.5).

A finished (or interrupted) sequence leaves its **global KV** (per KV source: packed main KV + index keys of
every entry, and the ratio-2 compressor carry: 890 B/token at release size) here, keyed by the SHA-256 of its
token ids, in host RAM and, with a directory, on disk through tensorstore (one zarr byte array per entry plus a
``meta.json``, written by a thread of its own so that decoding never waits for the disk; it survives a
restart). Its **SWA rings** go to a separate pool with a time-to-live: they are
never persisted. The device tier is the engine's own batch rows (a finished row keeps its state until the
row is needed): :mod:`dsv41_jax.serve.scheduler` looks there first.

Entries are keyed by a sequence's cache keys: its token ids, except that each image span's positions hold a
key derived from the image's pixels (:func:`dsv41_jax.serve.images.cache_keys`), so prompts whose ids agree but
whose images differ share nothing past the first differing span.

A lookup finds the entry sharing the longest token prefix with a prompt: a chain of block hashes (every
``BLOCK`` tokens) finds the deepest shared block, the tokens after it are compared one by one. Each tier
evicts least recently used entries beyond its byte budget.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

BLOCK = 16  # tokens per prefix-hash block


def entry_key(tokens: np.ndarray, salt: str = "") -> str:
    return hashlib.sha256(salt.encode() + b"\0" + np.asarray(tokens, np.int64).tobytes()).hexdigest()


def block_hashes(tokens: np.ndarray, salt: str = "") -> list[bytes]:
    """h_k = SHA-256(h_{k-1} ‖ block k) for every complete block of ``tokens``; h_0 = SHA-256(salt)."""
    out, h = [], hashlib.sha256(salt.encode()).digest()
    t = np.asarray(tokens, np.int64)
    for k in range(len(t) // BLOCK):
        h = hashlib.sha256(h + t[k * BLOCK:(k + 1) * BLOCK].tobytes()).digest()
        out.append(h)
    return out


@dataclass
class Entry:
    tokens: np.ndarray  # int32 [L]: what the global KV covers
    arrays: list[np.ndarray]  # per KV source its six SourceCache fields, entry rows [:ceil(L/m)]
    salt: str = ""  # the requests' cache_salt: entries are shared only between equal salts

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass
class Hit:
    tier: str  # "host" or "disk"
    entry: Entry
    length: int  # tokens shared with the prompt
    rings: list[np.ndarray] | None  # live SWA rings (only when the whole entry is shared), else None


class PrefixCache:
    """Host RAM and disk tiers of global KV, and the SWA ring pool."""

    def __init__(self, *, host_bytes: int, disk_dir: str | Path | None = None, disk_bytes: int = 0,
                 swa_bytes: int, swa_ttl: float):
        self.host_bytes, self.disk_bytes, self.swa_bytes, self.swa_ttl = host_bytes, disk_bytes, swa_bytes, swa_ttl
        self.host: OrderedDict[str, Entry] = OrderedDict()
        self.disk: OrderedDict[str, int] = OrderedDict()  # key -> bytes on disk
        self.swa: OrderedDict[str, tuple[float, list[np.ndarray]]] = OrderedDict()
        self.tokens: dict[str, np.ndarray] = {}  # every key of host ∪ disk
        self.salts: dict[str, str] = {}
        self.blocks: dict[bytes, set[str]] = {}
        self.dir = Path(disk_dir) if disk_dir else None
        self._writes: queue.Queue[tuple[str, Entry] | None] = queue.Queue()
        self._written: queue.Queue[tuple[str, int]] = queue.Queue()
        self._pending: set[str] = set()
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()
            self._writer = threading.Thread(target=self._write_loop, name="dsv41-prefix-writer", daemon=True)
            self._writer.start()

    def flush(self) -> None:
        """Wait until every entry handed to the disk tier is written (at shutdown)."""
        if self.dir is not None:
            self._writes.join()
            self._collect()

    # -- tiers' sizes (metrics)
    def tier_bytes(self) -> dict[str, int]:
        return {"host": sum(e.nbytes for e in self.host.values()), "disk": sum(self.disk.values()),
                "swa": sum(sum(r.nbytes for r in rings) for _, rings in self.swa.values())}

    def put(self, entry: Entry, rings: list[np.ndarray] | None) -> None:
        """Keep ``entry`` in host RAM (written through to disk) and its rings in the pool."""
        key = entry_key(entry.tokens, entry.salt)
        if key not in self.tokens:
            self._index(key, entry.tokens, entry.salt)
        self.host[key] = entry
        self.host.move_to_end(key)
        if self.dir is not None and key not in self.disk and key not in self._pending:
            self._pending.add(key)
            self._writes.put((key, entry))
        if rings is not None:
            self.swa[key] = (time.monotonic(), rings)
            self.swa.move_to_end(key)
        self._evict()

    def lookup(self, prompt: np.ndarray, max_length: int, salt: str = "") -> Hit | None:
        """The entry of ``salt`` sharing the longest prefix (at most ``max_length`` tokens) with ``prompt``."""
        self._collect()
        best_key, best = None, 0
        for h in block_hashes(prompt[:max_length], salt):
            keys = self.blocks.get(h)
            if not keys:
                break
            for key in keys:
                t = self.tokens[key]
                n = min(len(t), max_length)
                same = int(np.argmin(np.append(t[:n] == prompt[:n], False)))  # length of the common prefix
                if same > best:
                    best_key, best = key, same
        if best_key is None:
            return None
        if best_key not in self.host and best_key not in self.disk:  # left host RAM while its write is queued
            self.flush()
        tier = "host" if best_key in self.host else "disk"
        entry = self.host[best_key] if tier == "host" else self._read(best_key)
        self.host[best_key] = entry
        self.host.move_to_end(best_key)
        if best_key in self.disk:
            self.disk.move_to_end(best_key)
        rings = None
        if best == len(entry.tokens) and best_key in self.swa:
            stamp, live = self.swa[best_key]
            if time.monotonic() - stamp <= self.swa_ttl:
                rings = live
        self._evict()
        return Hit(tier, entry, best, rings)

    # -- internals
    def _index(self, key: str, tokens: np.ndarray, salt: str) -> None:
        self.tokens[key], self.salts[key] = np.asarray(tokens, np.int64), salt
        for h in block_hashes(tokens, salt):
            self.blocks.setdefault(h, set()).add(key)

    def _unindex(self, key: str) -> None:
        for h in block_hashes(self.tokens.pop(key), self.salts.pop(key)):
            self.blocks[h].discard(key)
            if not self.blocks[h]:
                del self.blocks[h]

    def _write_loop(self) -> None:
        while True:
            key, entry = self._writes.get()
            try:
                self._written.put((key, self._write(key, entry)))
            except OSError as err:  # a full or failing disk loses this entry from the disk tier, nothing else
                print(f"warning: prefix cache: cannot write {self.dir / key}: {err}", flush=True)
                self._written.put((key, -1))
            finally:
                self._writes.task_done()

    def _collect(self) -> None:
        """Entries the writer finished: now in the disk tier (indexed again if host RAM dropped them)."""
        while True:
            try:
                key, size = self._written.get_nowait()
            except queue.Empty:
                break
            self._pending.discard(key)
            if size < 0:
                if key not in self.host and key in self.tokens:
                    self._unindex(key)
                continue
            self.disk[key] = size
            if key not in self.tokens:
                meta = json.loads((self.dir / key / "meta.json").read_text())
                self._index(key, np.asarray(meta["tokens"], np.int64), meta["salt"])
        self._evict()

    def _evict(self) -> None:
        now = time.monotonic()
        for key in [k for k, (stamp, _) in self.swa.items() if now - stamp > self.swa_ttl]:
            del self.swa[key]
        while self.swa and self.tier_bytes()["swa"] > self.swa_bytes:
            self.swa.popitem(last=False)
        while self.host and sum(e.nbytes for e in self.host.values()) > self.host_bytes:
            key, _ = self.host.popitem(last=False)
            if key not in self.disk and key not in self._pending:
                self._unindex(key)
        while self.disk and sum(self.disk.values()) > self.disk_bytes:
            key, _ = self.disk.popitem(last=False)
            shutil.rmtree(self.dir / key, ignore_errors=True)
            if key not in self.host:
                self._unindex(key)

    def _write(self, key: str, entry: Entry) -> int:
        """One zarr byte array of every array's bytes, then meta.json; renamed into place when complete."""
        import tensorstore as ts

        blob = np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in entry.arrays])
        tmp = self.dir / f".{key}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp / "kv")},
                         "metadata": {"chunks": [int(min(max(blob.size, 1), 1 << 24))]}},
                        create=True, dtype=ts.uint8, shape=[blob.size]).result()
        store.write(blob).result()
        meta = {"tokens": entry.tokens.tolist(), "salt": entry.salt, "shapes": [list(a.shape) for a in entry.arrays],
                "dtypes": [a.dtype.name for a in entry.arrays]}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(self.dir / key)
        return int(blob.size)

    def _read(self, key: str) -> Entry:
        import tensorstore as ts

        meta = json.loads((self.dir / key / "meta.json").read_text())
        blob = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(self.dir / key / "kv")}}
                       ).result().read().result()
        arrays, at = [], 0
        for shape, name in zip(meta["shapes"], meta["dtypes"], strict=True):
            dtype = jnp.dtype(name)
            n = int(np.prod(shape)) * dtype.itemsize
            arrays.append(np.asarray(blob[at: at + n]).view(dtype).reshape(shape))
            at += n
        return Entry(np.asarray(meta["tokens"], np.int64), arrays, meta["salt"])

    def _scan_disk(self) -> None:
        """Index the entries a previous server left (oldest first for LRU); drop half-written ones."""
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
            elif (path / "meta.json").is_file():
                found.append((path.stat().st_mtime, path))
        for _, path in sorted(found):
            meta = json.loads((path / "meta.json").read_text())
            tokens = np.asarray(meta["tokens"], np.int64)
            if entry_key(tokens, meta["salt"]) != path.name:
                continue  # not ours
            self._index(path.name, tokens, meta["salt"])
            self.disk[path.name] = sum(int(np.prod(s)) * jnp.dtype(d).itemsize
                                       for s, d in zip(meta["shapes"], meta["dtypes"], strict=True))
        self._evict()
