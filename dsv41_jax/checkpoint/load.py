"""Build our model from a release-format Hugging Face directory (dequantised weights) or from the Orbax
checkpoint ``dsv41 convert`` writes (any weights mode, optionally sharded over a mesh); :func:`load_model`
takes either, or a training run directory, as ``dsv41 sample`` / ``dsv41 score`` and the infer/ scripts do."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsv41_jax import config as C
from dsv41_jax.checkpoint.hf import load_hf_params
from dsv41_jax.checkpoint.quiet import quiet_orbax_errors, reason
from dsv41_jax.checkpoint.store import restore_arrays, stored_arrays
from dsv41_jax.checkpoint.tree import NON_BACKBONE_PREFIXES, assign, flat_variables
from dsv41_jax.engram_hash import EngramHasher, build_token_map, check_token_map
from dsv41_jax.model.dspark import DSpark, abstract_drafter
from dsv41_jax.model.transformer import Transformer, abstract_model
from dsv41_jax.sharding import state_partition_specs


def model_from_hf(hf_dir: str | os.PathLike, *, dtype: str = "float32", param_dtype: str = "float32"
                  ) -> tuple[Transformer, EngramHasher]:
    """The text backbone with the checkpoint's weights, and the Engram hasher of its ``tokenizer.json``."""
    hf_dir = _local("--hf-dir", hf_dir)
    cfg = C.from_hf(hf_dir).replace(dtype=dtype, param_dtype=param_dtype)
    model = _placeholder(abstract_model(cfg))
    assign(model, load_hf_params(hf_dir, include=lambda name: not name.startswith(NON_BACKBONE_PREFIXES)))
    token_map = build_token_map(hf_dir / "tokenizer.json")
    check_token_map(token_map, cfg.engram)
    return model, EngramHasher(cfg.engram, token_map)


def drafter_from_hf(hf_dir: str | os.PathLike, cfg: C.ModelConfig) -> DSpark:
    """The DSpark drafter (``mtp.*``) of a release-format directory, for the backbone config ``cfg``."""
    drafter = _placeholder(abstract_drafter(cfg))
    assign(drafter, load_hf_params(hf_dir, include=lambda name: name.startswith("mtp.")), ignore_prefixes=())
    return drafter


def drafter_from_orbax(ckpt_dir: str | os.PathLike, cfg: C.ModelConfig) -> DSpark:
    """The DSpark drafter (``mtp.*``) of a converted checkpoint, for the config the backbone was restored with."""
    from dsv41_jax.checkpoint.convert import read_manifest

    ckpt_dir = _local("--ckpt", ckpt_dir)
    params_dir = ckpt_dir / read_manifest(ckpt_dir)["params"]
    drafter = abstract_drafter(cfg)
    variables = flat_variables(drafter)
    _check_stored(ckpt_dir, variables, stored_arrays(params_dir))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays = restore_arrays(params_dir, {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one)
                                         for n, v in variables.items()})
    for name, var in variables.items():
        var.set_value(arrays[name])
    return drafter


def load_drafter(cfg: C.ModelConfig, *, ckpt: str | os.PathLike | None = None,
                 hf_dir: str | os.PathLike | None = None) -> DSpark:
    """The DSpark drafter stored beside the backbone in a converted checkpoint or a release-format directory."""
    if (ckpt is None) == (hf_dir is None):
        raise ValueError("load_drafter: give exactly one of ckpt, hf_dir (a training run holds no drafter)")
    try:
        if ckpt is not None:
            return drafter_from_orbax(_local("--ckpt", ckpt), cfg)
        return drafter_from_hf(_local("--hf-dir", hf_dir), cfg)
    except (C.ConfigError, TypeError, AttributeError, NameError, AssertionError):
        raise
    except Exception as err:
        where = f"--ckpt {ckpt}" if ckpt is not None else f"--hf-dir {hf_dir}"
        raise CheckpointUnreadable(f"{where}: cannot load the DSpark drafter (mtp.*): {reason(err)}") from err


def _placeholder(module: nnx.Module) -> nnx.Module:
    """An abstract module with concrete zero leaves, to be overwritten by :func:`assign`."""
    for var in jax.tree.leaves(nnx.state(module), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        var.set_value(np.zeros(var.shape, var.dtype))
    return module


def _shardings(model: Transformer, mesh: jax.sharding.Mesh | None) -> dict[str, jax.sharding.Sharding]:
    """{name: sharding}: one device, or each variable's ``state_partition_specs`` entry on ``mesh``."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return dict.fromkeys(flat_variables(model), one)
    specs = state_partition_specs(nnx.state(model), mesh=mesh)
    leaves, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    return {".".join(str(k.key) for k in path): NamedSharding(mesh, spec) for path, spec in leaves}


def _check_stored(ckpt_dir: Path, variables: dict[str, nnx.Variable], stored: dict) -> None:
    """Every model array present with its shape; stored FP8 / FP4 / E8M0 bytes never cast into floats."""
    missing = sorted(set(variables) - set(stored))
    wrong = [f"{n}: stored {list(stored[n][0])} {stored[n][1]}, model {list(v.shape)} {v.dtype}"
             for n, v in variables.items() if n in stored
             and (tuple(stored[n][0]) != tuple(v.shape) or (stored[n][1].itemsize == 1) != (v.dtype.itemsize == 1))]
    if missing or wrong:
        lines = ([f"missing ({len(missing)}): {', '.join(missing[:20])}"] if missing else []) + \
                ([f"shape/format mismatch ({len(wrong)}): {'; '.join(wrong[:20])}"] if wrong else [])
        raise ValueError(f"{ckpt_dir}: the checkpoint does not fit the model of its config.json:\n  "
                         + "\n  ".join(lines))


def model_from_orbax(ckpt_dir: str | os.PathLike, *, dtype: str = "float32", param_dtype: str | None = None,
                     mesh: jax.sharding.Mesh | None = None) -> tuple[Transformer, EngramHasher]:
    """The text backbone restored from a converted checkpoint, and the Engram hasher of its tokenizer.

    The model's ``weight_format`` follows the checkpoint (``native`` conversions give a model that keeps FP8 /
    FP4 weights and dequantises on the fly). ``param_dtype`` defaults to bfloat16 for ``native`` and ``bf16``
    conversions and float32 for ``fp32``; stored float arrays are cast to it while reading. With ``mesh``,
    every array is read shard by shard onto the devices ``state_partition_specs`` assigns it; only the
    backbone's arrays are read (``mtp.*``, ``vision.*`` ... stay on disk for the modules that own them).
    """
    from dsv41_jax.checkpoint.convert import read_manifest

    ckpt_dir = _local("--ckpt", ckpt_dir)  # a URI: its local mirror
    manifest = read_manifest(ckpt_dir)
    default = "float32" if manifest["weights"] == "fp32" else "bfloat16"
    cfg = C.from_hf(ckpt_dir / "config.json").replace(
        dtype=dtype, param_dtype=param_dtype or default, weight_format=manifest["weight_format"])
    model = abstract_model(cfg)
    variables = flat_variables(model)
    params_dir = ckpt_dir / manifest["params"]
    _check_stored(ckpt_dir, variables, stored_arrays(params_dir))
    shardings = _shardings(model, mesh)
    targets = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[n]) for n, v in variables.items()}
    arrays = restore_arrays(params_dir, targets)
    for name, var in variables.items():
        var.set_value(arrays[name])
    token_map = build_token_map(ckpt_dir / "tokenizer.json")
    check_token_map(token_map, cfg.engram)
    return model, EngramHasher(cfg.engram, token_map)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model ready to run, with what sampling and scoring need beside it."""

    model: Transformer
    hasher: EngramHasher
    tokenizer: Path  # the tokenizer.json that goes with the weights
    step: int | None = None  # the training step, for a run directory


def load_model(*, run: str | os.PathLike | None = None, ckpt: str | os.PathLike | None = None,
               hf_dir: str | os.PathLike | None = None, dtype: str = "float32", param_dtype: str | None = None,
               log=print) -> Loaded:
    """The model of exactly one source: a ``dsv41 train`` run directory (its newest good step), an Orbax
    checkpoint written by ``dsv41 convert``, or a release-format Hugging Face directory.

    ``dtype`` is the activation precision; ``param_dtype`` applies to ``ckpt`` (default: by the conversion's
    weights) and ``hf_dir`` (default float32); a run keeps the parameter dtype it was trained with.
    """
    if sum(s is not None for s in (run, ckpt, hf_dir)) != 1:
        raise ValueError("load_model: give exactly one of run, ckpt, hf_dir")
    if run is not None:
        from dsv41_jax.train.checkpoint import model_from_run

        model, hasher, tok, step = model_from_run(run, dtype=dtype, log=log)
        return Loaded(model, hasher, Path(tok), step)
    flag, where = ("--ckpt", ckpt) if ckpt is not None else ("--hf-dir", hf_dir)
    where = _local(flag, where, log)
    if ckpt is not None:
        ckpt = where
    else:
        hf_dir = where
    quiet_orbax_errors()
    if not Path(where).is_dir():
        raise CheckpointUnreadable(f"{flag} {where}: no such directory")
    if not (Path(where) / "tokenizer.json").is_file():
        raise CheckpointUnreadable(f"{flag} {where}: no tokenizer.json (the Engram token map and the prompts' "
                                   "tokens come from it)")
    try:
        if ckpt is not None:
            model, hasher = model_from_orbax(ckpt, dtype=dtype, param_dtype=param_dtype)
        else:
            model, hasher = model_from_hf(hf_dir, dtype=dtype, param_dtype=param_dtype or "float32")
    except (C.ConfigError, TypeError, AttributeError, NameError, AssertionError):
        raise  # already one line, or a bug: keep its traceback
    except Exception as err:  # OSError, JSON, safetensors, tensorstore and Orbax read errors: the files are at fault
        raise CheckpointUnreadable(f"{flag} {where}: cannot load the checkpoint: {reason(err)}") from err
    return Loaded(model, hasher, Path(where) / "tokenizer.json")


def _local(flag: str, where, log=print) -> Path:
    """``where``, or (a URI) its local mirror, the whole directory copied down the first time it is read."""
    from dsv41_jax.checkpoint.convert import INDEX, MANIFEST
    from dsv41_jax.train.remote import local_copy

    return local_copy(where, MANIFEST if flag == "--ckpt" else INDEX, flag, log)


class CheckpointUnreadable(C.ConfigError):
    """A checkpoint on disk that cannot be read (missing, truncated or corrupt files); the message names it."""


def vision_encoder(*, ckpt: str | os.PathLike | None = None, hf_dir: str | os.PathLike | None = None,
                   dtype: str = "float32", param_dtype: str | None = None):
    """The vision tower (``dsv41_jax.vision.VisionEncoder``: ViT, aligner, span delimiters) of a converted
    (``ckpt``) or release-format (``hf_dir``) checkpoint; ``param_dtype`` defaults as for the backbone."""
    from dsv41_jax.vision.encoder import PREFIXES, VisionEncoder

    if (ckpt is None) == (hf_dir is None):
        raise ValueError("vision_encoder: give exactly one of ckpt, hf_dir")
    where = _local("--ckpt" if ckpt is not None else "--hf-dir", ckpt if ckpt is not None else hf_dir)
    if ckpt is not None:
        from dsv41_jax.checkpoint.convert import read_manifest

        default = "float32" if read_manifest(where)["weights"] == "fp32" else "bfloat16"
    cfg = C.from_hf(where / "config.json" if ckpt is not None else where)
    pdt = param_dtype or (default if ckpt is not None else "float32")
    encoder = nnx.eval_shape(lambda: VisionEncoder(cfg.vision, cfg.dim, dtype=dtype, param_dtype=pdt,
                                                   rngs=nnx.Rngs(0)))
    variables = flat_variables(encoder)
    if ckpt is not None:
        params_dir = where / read_manifest(where)["params"]
        _check_stored(where, variables, stored_arrays(params_dir))
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        arrays = restore_arrays(params_dir, {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one)
                                             for n, v in variables.items()})
    else:
        arrays = load_hf_params(where, include=lambda name: name.startswith(PREFIXES))
        if not arrays:
            raise ValueError(f"--hf-dir {where}: the checkpoint has no vision tower (vision.*, aligner.*, image_*)")
    for var in variables.values():
        var.set_value(np.zeros(var.shape, var.dtype))  # concrete placeholders, overwritten by assign
    assign(encoder, arrays, ignore_prefixes=())
    return encoder
