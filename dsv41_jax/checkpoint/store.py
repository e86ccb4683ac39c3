"""Our parameter tree on disk: an Orbax PyTree checkpoint whose arrays are written one slab at a time.

Orbax's own save writes every array of a tree in one call, from arrays held in memory. The release is
510 GB, so the converter writes each array itself with tensorstore (zarr v2 with Orbax's compressor, one
array per directory: Orbax's non-OCDBT layout) and afterwards lets Orbax write the tree metadata over
the finished arrays. The result is an ordinary Orbax checkpoint: any Orbax ``PyTreeCheckpointHandler``
restores it, partially and sharded.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tensorstore as ts

__all__ = ["create_array", "nest", "restore_arrays", "stored_arrays", "write_tree_metadata"]

_COMPRESSOR = {"id": "zstd", "level": 1}  # what Orbax's NumpyHandler writes


def nest(flat: Mapping[str, object]) -> dict:
    """``{"a.b.c": v}`` -> ``{"a": {"b": {"c": v}}}``; Orbax names the leaf by the joined path again."""
    tree: dict = {}
    for name in sorted(flat):
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"parameter {name!r}: a prefix of it is itself a parameter")
        if leaf in node:
            raise ValueError(f"parameter {name!r} is also the prefix of another parameter")
        node[leaf] = flat[name]
    return tree


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


_CONTEXT = None


def create_array(params_dir: Path, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 chunks: tuple[int, ...]) -> ts.TensorStore:
    """A new zarr array at ``params_dir/name``, where Orbax looks for leaf ``name`` (an old one is replaced)."""
    global _CONTEXT
    # one context for all arrays (its thread pools are built once); no fsync per file: the converter syncs
    # in batches before it journals an array as finished
    _CONTEXT = _CONTEXT or ts.Context({"file_io_sync": False})
    path = params_dir / name
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"compressor": _COMPRESSOR}}
    return ts.open(spec, create=True, delete_existing=path.exists(), dtype=np.dtype(dtype), shape=shape,
                   chunk_layout=ts.ChunkLayout(chunk_shape=chunks), context=_CONTEXT).result()


class _Written:
    """A leaf standing for an array that is already on disk (only its shape and dtype are needed)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize


def _registry():
    import orbax.checkpoint as ocp

    class WrittenHandler(ocp.type_handlers.NumpyHandler):
        """Records a written array like a numpy leaf (so plain Orbax restores it) without rewriting it."""

        async def serialize(self, values, infos, args=None):
            return []  # nothing to write, so nothing to wait for; the tree metadata is the handler's job

    return ocp.type_handlers.create_type_handler_registry((_Written, WrittenHandler()))


def write_tree_metadata(params_dir: Path, arrays: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Let Orbax write its metadata for the arrays ``{name: (shape, dtype)}`` already in ``params_dir``."""
    import orbax.checkpoint as ocp
    from etils import epath

    missing = [n for n in arrays if not (params_dir / n / ".zarray").is_file()]
    if missing:
        raise FileNotFoundError(f"{params_dir}: {len(missing)} array(s) were never written, e.g. {missing[:5]}")
    tree = nest({n: _Written(*spec) for n, spec in arrays.items()})
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns that a registry without jax.Array keeps no array metadata
    try:
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=_registry())
        handler.save(epath.Path(params_dir), args=ocp.args.PyTreeSave(tree))
        handler.finalize(epath.Path(params_dir))
    finally:
        absl.setLevel(level)


def stored_arrays(params_dir: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of every array in the checkpoint, from Orbax's metadata (no data read)."""
    import orbax.checkpoint as ocp
    from etils import epath

    if not (Path(params_dir) / "_METADATA").is_file():
        raise FileNotFoundError(f"{params_dir}: not an Orbax checkpoint (no _METADATA)")
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(params_dir)).tree
    return {n: (tuple(m.shape), np.dtype(m.dtype)) for n, m in _flatten(meta).items()}


def _restore(params_dir: Path, targets: Mapping[str, object]) -> dict[str, object]:
    import orbax.checkpoint as ocp
    from etils import epath

    tree = nest(dict(targets))
    restore_args = nest({n: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype, global_shape=t.shape)
                         for n, t in targets.items()})
    handler = ocp.PyTreeCheckpointHandler()
    out = handler.restore(epath.Path(params_dir),
                          args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args, partial_restore=True))
    return _flatten(out)


def restore_arrays(params_dir: Path, targets: Mapping[str, object], *, group_bytes: int = 8 << 30,
                   progress: bool | None = None, stream=None) -> dict[str, object]:
    """Read ``{name: jax.ShapeDtypeStruct with sharding}`` as jax arrays (cast to the target dtype).

    Only the named arrays are read (Orbax partial restore); each device reads just its shard. Arrays are read
    in groups of about ``group_bytes`` (their logical size), and ``progress`` (default: when there is more than
    one group) reports the bytes restored, a rate and an ETA on stderr: the release's 500 GB take minutes.
    """
    from dsv41_jax.checkpoint.progress import Progress, human_bytes, human_seconds

    size = {n: math.prod(t.shape) * np.dtype(t.dtype).itemsize for n, t in targets.items()}
    groups: list[list[str]] = [[]]
    for name in targets:
        if groups[-1] and sum(size[n] for n in groups[-1]) + size[name] > group_bytes:
            groups.append([])
        groups[-1].append(name)
    total = sum(size.values())
    prog = Progress(total, stream=stream, enabled=len(groups) > 1 if progress is None else progress,
                    interval=0.0, prefix="restore")
    out: dict[str, object] = {}
    for group in groups:
        out |= _restore(params_dir, {n: targets[n] for n in group})
        prog.advance(sum(size[n] for n in group), group[-1])
    prog.finish(f"restored {len(targets)} arrays ({human_bytes(total)}) from {params_dir} in "
                f"{human_seconds(time.monotonic() - prog.t0)}")
    return out


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory synced too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
