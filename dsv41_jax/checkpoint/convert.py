"""``dsv41 convert``: a release-format HF directory -> an Orbax checkpoint of our parameter tree.

Output directory::

    OUT/config.json             the source's config.json, byte for byte (spec model §1.1)
    OUT/tokenizer.json          copied; the Engram token map is derived from it (spec model §6.2)
    OUT/model.safetensors.index.json, OUT/inference/config.json, OUT/tokenizer_config.json
                                copied where present: ``dsv41 export`` writes the same shards and files
    OUT/dsv41_checkpoint.json   manifest: weights mode, source fingerprint, arrays and bytes
    OUT/params/                 Orbax PyTree checkpoint, one zarr array per parameter (``store.py``)

What is written and how each band of it is computed lives in ``plan.py``. This module runs it:
validation before any data moves, a progress line in bytes with an ETA, bounded memory (each array is
written band by band, at most ``chunk_bytes`` of output per band, two bands in flight), resumability (the
work happens in ``OUT.partial/``; finished arrays are journaled once their data is synced, and a rerun of
the same command skips them), and an atomic finish (Orbax metadata, copies, manifest, then one rename to ``OUT``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dsv41_jax import config as C
from dsv41_jax.checkpoint import store
from dsv41_jax.checkpoint.hf import read_hf_config
from dsv41_jax.checkpoint.inventory import is_quantised
from dsv41_jax.checkpoint.plan import MODES, ConvertError, Output, bands, chunk_shape, plan_outputs, produce
from dsv41_jax.checkpoint.progress import Progress, human_bytes, human_seconds
from dsv41_jax.checkpoint.safetensors import SafetensorsError, ShardedCheckpoint

__all__ = ["MANIFEST", "PARAMS", "ConvertError", "ConvertResult", "convert", "parse_mesh", "read_manifest"]

MANIFEST = "dsv41_checkpoint.json"
INDEX = "model.safetensors.index.json"  # a release-format directory's file that names every shard
PARAMS = "params"
FORMAT, VERSION = "dsv41-orbax-params", 1
MESH_AXES = ("data", "fsdp", "expert", "tensor")  # dsv41_jax.sharding
_JOURNAL, _SETTINGS = "journal.jsonl", "convert.json"
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
           "inference/config.json")


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    weights: str
    n_arrays: int
    written: int  # arrays written by this run
    skipped: int  # arrays an interrupted run had finished
    source_bytes: int
    output_bytes: int  # logical bytes of all arrays (on disk they are zstd-compressed)
    seconds: float


def parse_mesh(text: str | None) -> dict[str, int] | None:
    """``"fsdp=8,expert=4"`` -> every mesh axis of ``dsv41_jax.sharding`` with its size (default 1)."""
    if not text:
        return None
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ConvertError(f"--mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE...] with AXIS in {MESH_AXES}")
        sizes[key.strip()] = int(value)
    return sizes


def read_manifest(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{ckpt_dir}: no {MANIFEST}; not a finished `dsv41 convert` output") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')!r} v{manifest.get('version')} is not "
                         f"{FORMAT!r} v{VERSION}")
    return manifest


def _mesh_blocks(cfg: C.ModelConfig, weights: str, mesh: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Per model array, the shape of one shard on ``mesh`` (zarr chunks never straddle a shard)."""
    import jax

    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.sharding import logical_to_mesh

    amesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
    model = abstract_model(cfg.replace(weight_format="native" if weights == "native" else "float"))
    blocks = {}
    for name, var in flat_variables(model).items():
        axes = var.get_metadata().get("out_sharding")
        spec = logical_to_mesh(tuple(axes), None, tuple(var.shape), amesh) if axes else ()
        parts = [math.prod(amesh.shape[a] for a in ((s,) if isinstance(s, str) else s or ())) for s in spec]
        blocks[name] = tuple(d // p for d, p in zip(var.shape, parts + [1] * (len(var.shape) - len(parts)),
                                                      strict=True))
    return blocks


def _fingerprint(ckpt: ShardedCheckpoint) -> str:
    """SHA-256 over every (name, shard, dtype, shape) of the source: what a resumed run must see again."""
    rows = sorted((n, ckpt.shard_of(n), ckpt.info(n).dtype, list(ckpt.info(n).shape)) for n in ckpt.keys())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "holds a finished conversion" if (out / MANIFEST).is_file() else "exists and is not empty"
        raise ConvertError(f"--out {out} {what}; choose a new directory or delete it")


def _check_tokenizer(hf_dir: Path, cfg: C.ModelConfig) -> None:
    from dsv41_jax.engram_hash import build_token_map, check_token_map

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no tokenizer.json; the Engram token map is derived from it (spec model §6.2)")
    if cfg.engram.layer_ids:
        try:
            check_token_map(build_token_map(path), cfg.engram)
        except ValueError as e:
            raise ConvertError(f"{path}: {e}") from e


def _resume(partial: Path, settings: dict) -> set[str]:
    """Names an interrupted run of the same conversion finished; creates ``partial`` when new."""
    if not partial.exists():
        (partial / PARAMS).mkdir(parents=True)
        (partial / _SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
        return set()
    try:
        old = json.loads((partial / _SETTINGS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        old = None
    if old != settings:
        diff = sorted(k for k in settings if (old or {}).get(k) != settings[k])
        raise ConvertError(f"{partial} holds an interrupted conversion with other settings ({', '.join(diff)}); "
                           "rerun with the same source and options to resume, or delete it to start over")
    done = set()
    journal = partial / _JOURNAL
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            done.add(json.loads(line)["name"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line torn by the interruption: that array is redone
    return {n for n in done if (partial / PARAMS / n / ".zarray").is_file()}


class _Journal:
    """Names of finished arrays, made durable in batches: data first (``os.sync``), then the journal lines.

    Arrays are written without a sync per file (tensorstore's ``file_io_sync`` off: ~3x faster per small
    array), so a name is only journaled after a sync that covers its data; every 30 s or 4 GB, at the end,
    and when the run stops on an exception (the page cache still holds everything then). A power cut
    loses at most the last batch, which a rerun redoes.
    """

    def __init__(self, path: Path, seconds: float = 30.0, nbytes: int = 4 << 30):
        self.path, self.seconds, self.limit = path, seconds, nbytes
        self.pending: list[str] = []
        self.bytes, self.t = 0, time.monotonic()

    def add(self, name: str, nbytes: int) -> None:
        self.pending.append(name)
        self.bytes += nbytes
        if self.bytes >= self.limit or time.monotonic() - self.t >= self.seconds:
            self.commit()

    def commit(self) -> None:
        if self.pending:
            os.sync()
            with open(self.path, "a") as f:
                f.writelines(json.dumps({"name": n}) + "\n" for n in self.pending)
                f.flush()
                os.fsync(f.fileno())
        self.pending, self.bytes, self.t = [], 0, time.monotonic()

    def __enter__(self) -> _Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.commit()


def _write(out: Output, ckpt: ShardedCheckpoint, params_dir: Path, chunk_bytes: int,
           block: tuple[int, ...] | None, progress: Progress) -> None:
    """One array, band by band; the next band is computed while the previous one is written."""
    chunks = chunk_shape(out.shape, out.dtype.itemsize, chunk_bytes, block)
    array = store.create_array(params_dir, out.name, out.shape, out.dtype, chunks)
    per_value = out.src_bytes / max(math.prod(out.shape), 1)
    pending = None
    for region in bands(out.shape, chunks):
        data = produce(out, ckpt, region)
        if pending is not None:
            pending.result()
        pending = array[region].write(data)  # tensorstore copies `data`; it can be freed now
        progress.advance(per_value * data.size, out.name)
    if pending is not None:
        pending.result()


def _finish(partial: Path, out: Path, hf_dir: Path, outputs: list[Output], manifest: dict) -> None:
    """Orbax metadata, copies and manifest inside ``partial``, then one rename to ``out``."""
    store.write_tree_metadata(partial / PARAMS, {o.name: (o.shape, o.dtype) for o in outputs})
    for name in _COPIED:
        if (hf_dir / name).is_file():
            (partial / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(hf_dir / name, partial / name)
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for name in (_JOURNAL, _SETTINGS):
        (partial / name).unlink(missing_ok=True)
    os.sync()  # everything durable before the rename publishes it
    if out.exists():
        out.rmdir()  # empty, checked before starting
    os.replace(partial, out)
    store.fsync_dir(out.parent)


def _convert_to_uri(hf_dir: Path, uri: str, weights: str, mesh, chunk_bytes: int, progress: bool, stream,
                    say) -> ConvertResult:
    from dsv41_jax.train import remote

    t0 = time.monotonic()
    there = remote.remote_state(uri, MANIFEST, "--out")
    if there != "empty":
        what = "holds a finished conversion" if there == "finished" else "exists and is not empty"
        raise ConvertError(f"--out {uri} {what}; choose a new directory or delete it")
    local = remote.run_directory(uri, "--out")
    if (local / MANIFEST).is_file():  # converted before; its upload was cut off
        m = read_manifest(local)
        if m["weights"] != weights:
            raise ConvertError(f"--out {uri}: its local copy {local} holds a {m['weights']} conversion, not "
                               f"{weights}; delete it or convert to another --out")
        say(f"convert: {local} holds the finished conversion; copying it to {uri}")
        result = ConvertResult(uri, weights, m["n_arrays"], 0, m["n_arrays"], m["source"]["bytes"],
                               m["array_bytes"], 0.0)
    else:
        if local.is_dir() and not any(local.iterdir()):
            local.rmdir()
        result = convert(hf_dir, local, weights=weights, mesh=mesh, chunk_bytes=chunk_bytes, progress=progress,
                         stream=stream)
    remote.publish(local, uri, MANIFEST, say)
    return dataclasses.replace(result, out=uri, seconds=time.monotonic() - t0)


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, *, weights: str = "fp32",
            mesh: Mapping[str, int] | None = None, chunk_bytes: int = 256 << 20, progress: bool = True,
            stream: TextIO | None = None) -> ConvertResult:
    """Convert the HF checkpoint in ``hf_dir`` into ``out`` (see the module docstring).

    Rerunning after an interruption resumes; any inconsistency of the source is a ConvertError that lists
    the offending tensors by name before anything is written.
    """
    t0 = time.monotonic()
    if weights not in MODES:
        raise ConvertError(f"--weights {weights!r}: choose one of {', '.join(MODES)}")
    from dsv41_jax.train import remote

    say = (lambda m: print(m, file=stream or sys.stderr)) if progress else (lambda _: None)
    hf_dir = remote.local_copy(hf_dir, INDEX, "--hf-dir", say)
    if remote.is_uri(out):  # converted in the URI's local mirror (resumable there), then copied up, manifest last
        return _convert_to_uri(hf_dir, str(out), weights, mesh, chunk_bytes, progress, stream, say)
    out = Path(out)
    _check_out(out)
    if not (hf_dir / "config.json").is_file():
        raise ConvertError(f"--hf-dir {hf_dir}: no config.json (expected the release's directory layout)")
    cfg = C.from_hf(hf_dir)
    quantised = is_quantised(read_hf_config(hf_dir))  # else a bf16 export (plan.py)
    try:
        ckpt = ShardedCheckpoint(hf_dir)
        outputs = plan_outputs(ckpt, cfg, weights, quantised)
        fingerprint = _fingerprint(ckpt)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from e
    _check_tokenizer(hf_dir, cfg)
    blocks = _mesh_blocks(cfg, weights, mesh) if mesh else {}
    settings = {"weights": weights, "mesh": dict(mesh) if mesh else None, "source": fingerprint}
    partial = out.parent / f"{out.name}.partial"
    done = _resume(partial, settings)
    total = sum(o.src_bytes for o in outputs)
    prog = Progress(total, sum(o.src_bytes for o in outputs if o.name in done), stream=stream, enabled=progress)
    with _Journal(partial / _JOURNAL) as journal:
        for o in outputs:
            if o.name not in done:
                _write(o, ckpt, partial / PARAMS, chunk_bytes, blocks.get(o.name), prog)
                journal.add(o.name, o.nbytes)
    ckpt.close()
    out_bytes = sum(o.nbytes for o in outputs)
    manifest = {"format": FORMAT, "version": VERSION, "weights": weights,
                "weight_format": "native" if weights == "native" else "float", "params": PARAMS,
                "n_arrays": len(outputs), "array_bytes": out_bytes, "mesh": settings["mesh"],
                "source": {"dir": str(hf_dir.resolve()), "fingerprint": fingerprint, "tensors": len(ckpt),
                           "bytes": total, "storage": "release" if quantised else "bf16"}}
    _finish(partial, out, hf_dir, outputs, manifest)
    seconds = time.monotonic() - t0
    what = weights if quantised else f"{weights} from bf16 weights" + (", encoded by the release's rules"
                                                                        if weights == "native" else "")
    prog.finish(f"converted {human_bytes(total)} in {human_seconds(seconds)}: {len(outputs)} arrays "
                f"({human_bytes(out_bytes)}, {what}) in {out}")
    return ConvertResult(out, weights, len(outputs), len(outputs) - len(done), len(done), total, out_bytes,
                         seconds)
