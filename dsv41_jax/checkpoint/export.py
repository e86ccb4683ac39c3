"""``dsv41 export``: an Orbax checkpoint or a training run -> the release's Hugging Face format.

The inverse of ``dsv41 convert``. The output has the release's tensor names, dtypes and shapes (FP8 E4M3 with
E8M0 block scales, packed FP4 routed experts, BF16 / F32 elsewhere: ``inventory.expected_inventory``), shards
and index, ``config.json``, ``inference/config.json`` and tokenizer files.

- Arrays a native conversion kept as stored (FP8 / FP4 codes and their scales) are written back as they are;
  float arrays are encoded by the release's rules (:mod:`.encode`, spec model §2.2), keeping a known source
  scale for every block it still encodes exactly. So release -> ``convert --weights native`` -> ``export``
  gives the release back byte for byte, shards and index included.
- A run holds the text backbone only; DSpark (``mtp.*``) and vision arrays, and the source scales, come from
  ``base``: a converted checkpoint, by default the run's ``posttrain.init_from`` when it is one.
- Memory: a converted checkpoint is read band by band (at most ``chunk_bytes`` of float values at a time) and
  each shard is written band by band; a run's parameters are restored whole, as ``dsv41 sample`` does.
- ``weights="bf16"`` writes Hugging Face's dequantised form instead (``inventory.dequantised``, as DeepSeek's
  ``fp8_cast_bf16.py`` makes of an FP8 release): each FP8 / FP4 weight one BF16 tensor of its logical shape,
  no scale tensors, ``config.json`` without ``quantization_config`` and ``inference/config.json`` with
  ``"dtype": "bf16"`` and no ``expert_dtype``. Stored codes dequantise exactly (an E4M3 / E2M1 value times a
  power of two fits bf16), float weights are rounded to bf16. ``dsv41 convert`` reads it back.
The shards are written into ``OUT.partial/``, which is renamed to ``OUT`` when everything is there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsv41_jax import config as C
from dsv41_jax.checkpoint import encode
from dsv41_jax.checkpoint.convert import MANIFEST
from dsv41_jax.checkpoint.hf import _apply_block_scale, _decode_fp4, _scale_f32
from dsv41_jax.checkpoint.inventory import TensorSpec, dequantised, expected_inventory
from dsv41_jax.checkpoint.plan import ConvertError, _pairs, validate_source
from dsv41_jax.checkpoint.progress import Progress, human_bytes, human_seconds
from dsv41_jax.checkpoint.safetensors import DTYPES, ShardedCheckpoint, write_streamed
from dsv41_jax.train import remote

__all__ = ["WEIGHTS", "ExportResult", "export"]

WEIGHTS = ("native", "bf16")

INDEX = "model.safetensors.index.json"
_FILES = ("tokenizer.json", "tokenizer_config.json", "inference/config.json")
_U8 = np.dtype(np.uint8)


@dataclass(frozen=True)
class ExportResult:
    out: Path
    n_tensors: int
    n_shards: int
    bytes: int
    seconds: float


# ----------------------------------------------------------------------------- where values come from


class _Orbax:
    """The arrays of a ``dsv41 convert`` output, read band by band with tensorstore."""

    def __init__(self, ckpt_dir: Path):
        from dsv41_jax.checkpoint.convert import read_manifest
        from dsv41_jax.checkpoint.store import stored_arrays

        self.dir = Path(ckpt_dir)
        self.params = self.dir / read_manifest(self.dir)["params"]
        self.specs = stored_arrays(self.params)
        self._open: dict[str, object] = {}

    def rows(self, name: str, expert: int | None, r0: int, r1: int) -> np.ndarray:
        import tensorstore as ts

        if name not in self._open:
            spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(self.params / name)}}
            self._open[name] = ts.open(spec, open=True).result()
        arr = self._open[name]
        return arr[r0:r1].read().result() if expert is None else arr[expert, r0:r1].read().result()


class _Arrays:
    """Arrays in memory (a run's restored parameters)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.specs = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in self.arrays.items()}

    def rows(self, name: str, expert: int | None, r0: int, r1: int) -> np.ndarray:
        a = self.arrays[name]
        return np.asarray(a[r0:r1] if expert is None else a[expert, r0:r1])


class _Layered:
    """Each name from the first source that has it."""

    def __init__(self, *sources):
        self.sources = [s for s in sources if s is not None]
        self.specs = {}
        for s in reversed(self.sources):
            self.specs |= s.specs

    def rows(self, name: str, expert: int | None, r0: int, r1: int) -> np.ndarray:
        return next(s for s in self.sources if name in s.specs).rows(name, expert, r0, r1)


# ----------------------------------------------------------------------------- one group of stored tensors


@dataclass(frozen=True)
class _Group:
    """One of our arrays (experts stacked) and the stored tensors it becomes."""

    name: str
    weights: tuple[TensorSpec, ...]
    scales: tuple[TensorSpec, ...]
    stacked: bool
    kind: str  # "cast", "raw" (stored bytes as they are), "fp8" / "fp4" (encode float values) or "dequant"
    # (stored codes and scales -> float values, for a bf16 export)
    hint: bool  # a source scale is known (fp8 / fp4)

    @property
    def scale_name(self) -> str:
        return self.name[: -len("weight")] + "scale"

    @property
    def block(self) -> tuple[int, int]:
        fp4 = self.kind == "fp4" or ".ffn.experts." in self.name  # routed experts (a bf16 export's too)
        return (1, 32) if fp4 or ".engram.embed." in self.name else (32, 32)


def _group(name: str, ws, ss, stacked: bool, specs: Mapping[str, tuple]) -> _Group:
    if name not in specs:
        raise ConvertError(f"export: the checkpoint has no array {name!r} (and no --base supplies it)")
    sname = name[: -len("weight")] + "scale"
    if not ss:  # a plain float tensor, or a bf16 export's quantised weight: stored codes are dequantised
        codes = specs[name][1].itemsize == 1 and sname in specs
        return _Group(name, tuple(ws), (), stacked, "dequant" if codes else "cast", False)
    if specs[name][1].itemsize == 1:
        if sname not in specs:
            raise ConvertError(f"export: {name!r} is stored as {specs[name][1]} but {sname!r} is missing")
        return _Group(name, tuple(ws), tuple(ss), stacked, "raw", False)
    hint = sname in specs and specs[sname][1] == _U8 and specs[sname][0][-1] == ss[0].shape[-1]
    return _Group(name, tuple(ws), tuple(ss), stacked, "fp4" if ws[0].dtype == "I8" else "fp8", hint)


def _encoded(g: _Group, src, expert: int | None, v0: int, v1: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of value rows [v0, v1) (a whole number of scale blocks, or the end)."""
    values = src.rows(g.name, expert, v0, v1).astype(np.float32)
    br = g.block[0]
    hint = src.rows(g.scale_name, expert, v0 // br, -(-v1 // br)) if g.hint else None
    if g.kind == "fp4":
        return encode.fp4_rows(values, hint)
    return encode.fp8_blocks(values, g.block, hint)


def _dequantised(g: _Group, src, expert: int | None, v0: int, v1: int) -> np.ndarray:
    """Value rows [v0, v1) (whole scale blocks, or the end) of stored codes times their E8M0 scales, in f32
    (spec model §2.2)."""
    codes = src.rows(g.name, expert, v0, v1)
    values = _decode_fp4(codes) if codes.dtype == _U8 else codes.astype(np.float32)
    br = g.block[0]
    scales = src.rows(g.scale_name, expert, v0 // br, -(-v1 // br)).view(np.dtype("float8_e8m0fnu"))
    with np.errstate(over="ignore"):
        _apply_block_scale(values, _scale_f32(scales), g.block)
    return values


def _bands(g: _Group, src, tensor: TensorSpec, expert: int | None, is_scale: bool, budget: int
           ) -> Iterator[np.ndarray]:
    """The stored tensor's rows, band by band; each band reads at most ~``budget`` bytes of values."""
    dtype = DTYPES[tensor.dtype]
    rows = tensor.shape[0] if tensor.shape else 1
    if g.kind in ("cast", "raw"):
        name = g.scale_name if is_scale else g.name
        per_row = max(math.prod(tensor.shape[1:]) * 4, 1)
        step = max(1, budget // per_row)
        for r0 in range(0, rows, step):
            a = src.rows(name, expert, r0, min(rows, r0 + step))
            yield a.view(dtype) if g.kind == "raw" else encode.cast(a, dtype)
        return
    br = g.block[0]
    value_rows = g.weights[0].shape[0]
    per_value_row = max(math.prod(g.weights[0].shape[1:]) * (8 if g.kind == "fp4" else 4), 1)
    step = max(br, budget // per_value_row // br * br)  # value rows per band: whole scale blocks
    for v0 in range(0, value_rows, step):
        v1 = min(value_rows, v0 + step)
        if g.kind == "dequant":
            yield encode.cast(_dequantised(g, src, expert, v0, v1), dtype)
            continue
        codes, scales = _encoded(g, src, expert, v0, v1)
        yield (scales.view(dtype) if is_scale else codes.view(dtype))


# ----------------------------------------------------------------------------- the directory


def _shard_map(sources: list[Path], inventory: list[TensorSpec], shard_bytes: int) -> dict[str, str]:
    """{tensor: shard file}: the source's own index when it lists exactly these tensors, else by size with
    the Engram tables alone in the last shards, as the release lays them out (spec model §2.1)."""
    names = {t.name for t in inventory}
    for d in sources:
        if (d / INDEX).is_file():
            weight_map = json.loads((d / INDEX).read_text()).get("weight_map", {})
            if set(weight_map) == names:
                return dict(weight_map)
    from dsv41_jax.checkpoint.fake_hf import _assign_shards

    groups = sorted(_pairs(inventory), key=lambda g: g[0].endswith("engram.embed.weight"))  # stable: Engram last
    shards = _assign_shards(groups, shard_bytes)
    out = {}
    for k, members in enumerate(shards):
        for i in members:
            _, ws, ss, _ = groups[i]
            out |= dict.fromkeys((t.name for t in ws + ss), f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
    return out


def _storage_keys(name: str, text: str, cfg: C.ModelConfig, quantised: bool) -> str:
    """``config.json`` / ``inference/config.json`` saying how the weights are stored, unchanged when it does.
    FP8: the release's ``quantization_config`` (spec model §1.1), ``"dtype": "fp8"`` and ``"expert_dtype":
    "fp4"`` (§1.2); bf16: no ``quantization_config``, ``"dtype": "bf16"``, no ``expert_dtype``."""
    conf = json.loads(text)
    if name == "config.json":
        keys, before, indent = ("quantization_config",), "text_config", 2
        want = {"quantization_config": C.to_hf(cfg)["quantization_config"]} if quantised else {}
    else:
        keys, before, indent = ("dtype", "expert_dtype"), "compress_rope_theta", 4
        want = {"dtype": "fp8", "expert_dtype": "fp4"} if quantised else {"dtype": "bf16"}
    if {k: conf[k] for k in keys if k in conf} == want:
        return text
    rest = [(k, v) for k, v in conf.items() if k not in keys]
    at = next((i for i, (k, _) in enumerate(rest) if k == before), len(rest))  # where the release has them
    return json.dumps(dict(rest[:at] + list(want.items()) + rest[at:]), indent=indent) + "\n"


def _copy_files(out: Path, cfg: C.ModelConfig, sources: list[Path], config_from: Path | None,
                quantised: bool) -> list[str]:
    """config.json (the source's bytes, or written from the config), tokenizer and inference config files;
    the two config files say how the weights are stored."""
    if config_from is not None and (config_from / "config.json").is_file():
        text = (config_from / "config.json").read_text()
    else:
        text = C.to_hf_json(cfg)
    (out / "config.json").write_text(_storage_keys("config.json", text, cfg, quantised))
    missing = []
    for name in _FILES:
        src = next((d / name for d in sources if (d / name).is_file()), None)
        if src is None:
            missing.append(name)
            continue
        (out / name).parent.mkdir(exist_ok=True)
        if name == "inference/config.json":
            (out / name).write_text(_storage_keys(name, src.read_text(), cfg, quantised))
        else:
            shutil.copyfile(src, out / name)
    return missing


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not empty; choose a new directory or delete it")


def _is_converted(path: str | os.PathLike | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def _run_sources(run: Path, base: Path | None, log) -> tuple[object, C.ModelConfig, list[Path], Path | None]:
    """A run's parameters over ``base``'s arrays; its model config; where the other files come from."""
    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.posttrain.recipe import check_same_model, load_run_model, run_model_config, saved_run_config

    saved, step = saved_run_config(run)
    cfg = run_model_config(run, saved)
    if base is None:
        init_from = (saved.get("posttrain") or {}).get("init_from")
        if init_from is not None and remote.is_uri(init_from):  # a converted checkpoint at a URI (else a run's)
            from etils import epath

            init_from = remote.local_copy(init_from, MANIFEST, "posttrain.init_from", log) \
                if (epath.Path(init_from) / MANIFEST).exists() else None
        base = Path(init_from) if _is_converted(init_from) else None
    if base is not None:
        if not _is_converted(base):
            raise ConvertError(f"--base {base}: not a `dsv41 convert` output (no manifest)")
        check_same_model(cfg, C.from_hf(base / "config.json"), str(base))
        log(f"export: run {run} step {step}; DSpark, vision and source scales from {base}")
    model, _ = load_run_model(run, dtype="float32")
    arrays = {n: np.asarray(v[...]) for n, v in flat_variables(model).items()}
    src = _Layered(_Arrays(arrays), _Orbax(base) if base is not None else None)
    return src, cfg, [run] + ([base] if base is not None else []), None


def _sources(ckpt, run, base, log) -> tuple[object, C.ModelConfig, list[Path], Path | None]:
    if (ckpt is None) == (run is None):
        raise ValueError("export: give exactly one of ckpt, run")
    if base is not None:
        base = remote.local_copy(base, MANIFEST, "--base", log)
    if run is not None:
        return _run_sources(remote.local_run(run, log), base, log)
    ckpt = remote.local_copy(ckpt, MANIFEST, "--ckpt", log)
    if not _is_converted(ckpt):
        raise ConvertError(f"--ckpt {ckpt}: not a `dsv41 convert` output (no manifest); for a training run use --run")
    cfg = C.from_hf(ckpt / "config.json")
    if base is not None:
        raise ConvertError("--base applies to --run only: a converted checkpoint holds every array itself")
    return _Orbax(ckpt), cfg, [ckpt], ckpt


def _tensors(groups: list[_Group]) -> dict[str, tuple[_Group, int | None, bool, TensorSpec]]:
    """{stored tensor: (its group, expert, is a scale, spec)}."""
    where = {}
    for g in groups:
        for is_scale, specs in ((False, g.weights), (True, g.scales)):
            for i, t in enumerate(specs):
                where[t.name] = (g, i if g.stacked else None, is_scale, t)
    return where


def export(out: str | os.PathLike, *, ckpt: str | os.PathLike | None = None, run: str | os.PathLike | None = None,
           base: str | os.PathLike | None = None, weights: str = "native", chunk_bytes: int = 256 << 20,
           shard_bytes: int = 5 << 30, progress: bool = True, stream=None, log=print) -> ExportResult:
    """Write the checkpoint ``ckpt`` (a ``dsv41 convert`` output) or the newest step of the training ``run``
    into ``out`` in the release's Hugging Face format, its FP8 / FP4 storage or (``weights="bf16"``) the
    dequantised bf16 form (see the module docstring)."""
    t0 = time.monotonic()
    if weights not in WEIGHTS:
        raise ConvertError(f"export --weights {weights!r}: choose one of {', '.join(WEIGHTS)}")
    if remote.is_uri(out):  # written in the URI's local mirror, then copied up, the index last
        uri, out = str(out), remote.run_directory(out, "--out")
        if remote.remote_state(uri, INDEX, "--out") != "empty":
            raise ConvertError(f"--out {uri} exists and is not empty; choose a new directory or delete it")
        shutil.rmtree(out, ignore_errors=True)  # an earlier export there: exports restart whole
        result = export(out, ckpt=ckpt, run=run, base=base, weights=weights, chunk_bytes=chunk_bytes,
                        shard_bytes=shard_bytes, progress=progress, stream=stream, log=log)
        remote.publish(out, uri, INDEX, log)
        return dataclasses.replace(result, out=uri, seconds=time.monotonic() - t0)
    out = Path(out)
    _check_out(out)
    src, cfg, sources, config_from = _sources(ckpt, run, base, log)
    quantised = weights == "native"
    inventory = expected_inventory(cfg) if quantised else dequantised(expected_inventory(cfg))
    where = _tensors([_group(n, ws, ss, st, src.specs) for n, ws, ss, st in _pairs(inventory)])
    shard_of = _shard_map(sources, inventory, shard_bytes)
    partial = out.parent / f"{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)  # an interrupted export: nothing in it is trusted
    partial.mkdir(parents=True)
    total = sum(t.nbytes for t in inventory)
    prog = Progress(total, stream=stream, enabled=progress, prefix="export")

    def produce(name: str) -> Iterator[np.ndarray]:
        g, expert, is_scale, spec = where[name]
        for band in _bands(g, src, spec, expert, is_scale, chunk_bytes):
            prog.advance(band.nbytes, name)
            yield band

    shards = sorted(set(shard_of.values()))
    for shard in shards:
        specs = {n: (where[n][3].dtype, where[n][3].shape) for n, s in shard_of.items() if s == shard}
        write_streamed(partial / shard, specs, produce, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    (partial / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    missing = _copy_files(partial, cfg, sources, config_from, quantised)
    with ShardedCheckpoint(partial) as check:
        validate_source(check, cfg, quantised)  # the result reads as a checkpoint of its config.json
    if out.exists():
        out.rmdir()  # empty, checked before starting
    os.replace(partial, out)
    seconds = time.monotonic() - t0
    note = f"; not in the source, so not written: {', '.join(missing)}" if missing else ""
    prog.finish(f"exported {len(inventory)} {weights} tensors ({human_bytes(total)}) in {len(shards)} shards to "
                f"{out} in {human_seconds(seconds)}{note}")
    return ExportResult(out, len(inventory), len(shards), total, seconds)
