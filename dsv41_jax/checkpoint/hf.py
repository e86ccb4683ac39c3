"""Release-format HF checkpoint -> our parameter names, dequantised to float.

Our parameter tree keeps the checkpoint's own dotted names (spec model §2.8, last bullet) with one
change: routed experts `P.ffn.experts.{E}.wK.weight` are stacked along a new leading expert axis into
`P.ffn.experts.wK.weight` [E, out, in]. Quantised pairs `X.weight` + `X.scale` become one float
`X.weight` (spec model §2.2). HF-style aliases of spec model §2.6 are accepted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint.safetensors import (
    DTYPES,
    SafetensorsError,
    ShardedCheckpoint,
    TensorInfo,
)

__all__ = [
    "ParamPlan",
    "canonical_name",
    "load_hf_params",
    "plan_hf_params",
    "read_hf_config",
]

# spec model §2.6 step 3: component renames convert.py accepts (no-ops on the release itself).
_ALIASES = {"self_attn": "attn", "weight_scale_inv": "scale", "e_score_correction_bias": "bias"}
# spec model §2.6 step 4: DSpark stages share the backbone's embed/head, so per-stage copies are dropped.
_DROPPED = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn)\.experts\.(?P<e>\d+)\.(?P<rest>.+)$")
# Stored dtypes that are never meaningful without their `.scale` (spec model §2.4: F8 always paired;
# I8 is packed FP4).
_NEEDS_SCALE = {"F8_E4M3", "F8_E5M2", "I8", "U8"}
_FLOAT = {"BF16", "F16", "F32", "F64"}
_SCALE_DTYPES = {"F8_E8M0", "F32", "BF16"}

# spec model §2.2: E2M1 code = bit 3 sign, bits 0-2 index this magnitude table (code 8 is -0).
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
_E2M1 = np.concatenate([_E2M1, -_E2M1])
_CHUNK_ELEMS = 1 << 24  # rows are dequantised in chunks of ~16M values to bound temporaries


def canonical_name(hf_name: str) -> str:
    """The reference (= our) spelling of a checkpoint name; spec model §2.6 step 3."""
    name = hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name
    parts = name.split(".")
    in_vision = parts[0] == "vision"  # the ViT really calls its MLP `mlp` (spec model §2.4)
    return ".".join("ffn" if p == "mlp" and not in_vision else _ALIASES.get(p, p) for p in parts)


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """`config.json` of an HF checkpoint directory (HF composite form, spec model §1.1)."""
    path = Path(hf_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json in the checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


# ----------------------------------------------------------------------------- dequantisation


def _scale_f32(scale: np.ndarray) -> np.ndarray:
    """Scale multipliers as f32; E8M0 byte b means 2^(b-127), b=255 is NaN (spec model §2.2)."""
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        b = scale.view(np.uint8).astype(np.int32)
        out = np.ldexp(np.float32(1), np.minimum(b, 254) - 127).astype(np.float32)
        out[b == 255] = np.nan
        return out
    return scale.astype(np.float32)


def _decode_fp8(w: np.ndarray) -> np.ndarray:
    """F8 values (E4M3, or E5M2 as the reader typed it) as f32; raw uint8 bytes are read as E4M3."""
    return (w.view(ml_dtypes.float8_e4m3fn) if w.dtype == np.uint8 else w).astype(np.float32)


def _decode_fp4(packed: np.ndarray) -> np.ndarray:
    """[R, C/2] packed E2M1 bytes -> [R, C] f32; low nibble = even column (spec model §2.2)."""
    u = packed.view(np.uint8)
    out = np.empty((*u.shape, 2), np.float32)
    out[..., 0] = _E2M1[u & 0x0F]
    out[..., 1] = _E2M1[u >> 4]
    return out.reshape(*u.shape[:-1], 2 * u.shape[-1])


def _apply_block_scale(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> None:
    """In place: values[r, c] *= scale[r // br, c // bc]; ragged edge blocks allowed."""
    (rows, cols), (br, bc) = values.shape, block
    sr, sc = scale.shape
    if rows == sr * br and cols == sc * bc:
        values.reshape(sr, br, sc, bc)[...] *= scale[:, None, :, None]
    else:
        values *= np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]


def _dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int], out: np.ndarray) -> np.ndarray:
    """Dequantise an FP8 (E4M3) or packed-FP4 (I8/U8) weight into `out`, row chunk by row chunk.

    FP8: W = fp8 · s[r // br, c // bc]; dense weights use (32, 32), Engram tables (1, 32).
    FP4: W = e2m1(code) · s[r, c // 32] with block (1, 32). Spec model §2.2.
    """
    fp4 = weight.dtype.itemsize == 1 and weight.dtype.kind in "iu"
    decode = _decode_fp4 if fp4 else _decode_fp8
    rows, cols = out.shape
    br = block[0]
    step = max(br, (_CHUNK_ELEMS // max(cols, 1)) // br * br)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        vals = decode(np.asarray(weight[r0:r1]))
        s = _scale_f32(np.asarray(scale[r0 // br : -(-r1 // br)]))
        _apply_block_scale(vals, s, block)
        out[r0:r1] = vals
    return out


def _infer_block(name: str, w: TensorInfo, s: TensorInfo) -> tuple[tuple[int, int], tuple[int, int]]:
    """(logical weight shape, scale block) from the stored shapes (as convert.py infers it, §2.5)."""
    if len(w.shape) != 2 or len(s.shape) != 2:
        raise SafetensorsError(f"{name}: quantised weight {w.shape} / scale {s.shape} must both be 2-D")
    if s.dtype not in _SCALE_DTYPES:
        raise SafetensorsError(f"{name}: scale dtype {s.dtype} is not one of {sorted(_SCALE_DTYPES)}")
    fp4 = w.dtype in ("I8", "U8")
    shape = (w.shape[0], 2 * w.shape[1]) if fp4 else w.shape
    row_opts, col_opts = ((1,), (32,)) if fp4 else ((1, 32, 128), (32, 128))
    block = []
    for dim, sdim, opts in zip(shape, s.shape, (row_opts, col_opts), strict=True):
        fits = [b for b in opts if -(-dim // b) == sdim]
        if not fits:
            raise SafetensorsError(
                f"{name}: scale shape {list(s.shape)} does not tile {w.dtype} weight of logical shape"
                f" {list(shape)} with any block in {opts} (spec model §2.2)"
            )
        block.append(fits[0])
    return shape, (block[0], block[1])


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Source:
    weight: str  # checkpoint (index) name
    scale: str | None  # checkpoint name of the scale, for quantised pairs
    shape: tuple[int, ...]  # logical (dequantised) shape
    block: tuple[int, int] | None
    stored: str  # stored dtype of `weight`


@dataclass(frozen=True)
class ParamPlan:
    """How one output parameter is built: one source, or one per expert along a new axis 0."""

    name: str
    sources: tuple[_Source, ...]
    stacked: bool

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.sources[0].shape
        return (len(self.sources), *inner) if self.stacked else inner

    @property
    def quantised(self) -> bool:
        return self.sources[0].scale is not None

    def consumed(self) -> list[str]:
        return [n for s in self.sources for n in (s.weight, s.scale) if n is not None]


def _canonical_map(ckpt: ShardedCheckpoint) -> tuple[dict[str, str], list[str]]:
    """{canonical name: index name} and the dropped index names; rejects alias collisions."""
    canon: dict[str, str] = {}
    dropped: list[str] = []
    for hf in ckpt.keys():
        c = canonical_name(hf)
        if _DROPPED.match(c):
            dropped.append(hf)
        elif c in canon:
            raise SafetensorsError(
                f"{ckpt.dir}: {canon[c]!r} and {hf!r} both map to {c!r}; the index mixes name schemes"
            )
        else:
            canon[c] = hf
    return canon, dropped


def _sources(ckpt: ShardedCheckpoint, canon: dict[str, str]) -> dict[str, _Source]:
    """{canonical output name: source}, pairing X.weight with X.scale; all problems in one error."""
    problems: list[str] = []
    out: dict[str, _Source] = {}
    for c, hf in canon.items():
        if c.endswith(".scale"):
            if c[: -len("scale")] + "weight" not in canon:
                problems.append(f"{hf!r}: scale without its partner {c[:-5] + 'weight'!r}")
            continue
        info = ckpt.info(hf)
        scale = canon.get(c[: -len("weight")] + "scale") if c.endswith(".weight") else None
        if scale is None:
            if info.dtype in _NEEDS_SCALE:
                problems.append(f"{hf!r}: {info.dtype} weight without its partner .scale")
            out[c] = _Source(hf, None, info.shape, None, info.dtype)
        elif info.dtype not in _NEEDS_SCALE:
            problems.append(f"{hf!r}: has a .scale partner but is stored as {info.dtype}")
        else:
            shape, block = _infer_block(hf, info, ckpt.info(scale))
            out[c] = _Source(hf, scale, shape, block, info.dtype)
    if problems:
        raise SafetensorsError(f"{ckpt.dir}: {len(problems)} tensor(s) cannot be consumed:\n  " + "\n  ".join(problems))
    return out


def _stack_experts(name: str, by_expert: dict[int, _Source]) -> ParamPlan:
    """One stacked plan; experts must be 0..E-1 with identical formats (spec model §2.4)."""
    ids = sorted(by_expert)
    if ids != list(range(len(ids))):
        raise SafetensorsError(f"{name}: expert indices {ids} are not 0..{len(ids) - 1}")
    srcs = tuple(by_expert[e] for e in ids)  # numeric order: expert 10 after 9, not after 1
    kinds = {(s.shape, s.block, s.stored) for s in srcs}
    if len(kinds) != 1:
        raise SafetensorsError(f"{name}: experts differ in (shape, block, dtype): {sorted(kinds)}")
    return ParamPlan(name, srcs, stacked=True)


def plan_hf_params(ckpt: str | os.PathLike | ShardedCheckpoint) -> dict[str, ParamPlan]:
    """Output name -> how to build it, from headers only (no tensor data is read)."""
    ckpt = ckpt if isinstance(ckpt, ShardedCheckpoint) else ShardedCheckpoint(ckpt)
    ckpt.validate()
    canon, dropped = _canonical_map(ckpt)
    plans: dict[str, ParamPlan] = {}
    experts: dict[str, dict[int, _Source]] = {}
    for c, src in _sources(ckpt, canon).items():
        m = _EXPERT.match(c)
        if m:
            experts.setdefault(f"{m['prefix']}.experts.{m['rest']}", {})[int(m["e"])] = src
        else:
            plans[c] = ParamPlan(c, (src,), stacked=False)
    for name, by_expert in experts.items():
        if name in plans:
            raise SafetensorsError(f"{ckpt.dir}: {name!r} exists both stacked and per-expert")
        plans[name] = _stack_experts(name, by_expert)
    used = sorted(n for p in plans.values() for n in p.consumed()) + sorted(dropped)
    if len(used) != len(ckpt) or set(used) != set(ckpt.keys()):
        left = sorted(set(ckpt.keys()) - set(used))
        raise SafetensorsError(f"{ckpt.dir}: tensors not consumed exactly once; leftovers {left[:20]}")
    return dict(sorted(plans.items()))


# ----------------------------------------------------------------------------- loading


def _fill(ckpt: ShardedCheckpoint, src: _Source, out: np.ndarray) -> None:
    if src.scale is None:
        out[...] = ckpt.get(src.weight)
    else:
        _dequantize(ckpt.get(src.weight), ckpt.get(src.scale), src.block, out)


def _out_dtype(plan: ParamPlan, dtype) -> np.dtype:
    if plan.quantised:
        return np.dtype(np.float32 if dtype is None else dtype)
    stored = plan.sources[0].stored
    if dtype is None or stored not in _FLOAT:
        return DTYPES[stored]
    return np.dtype(dtype)


def load_hf_params(
    hf_dir: str | os.PathLike | ShardedCheckpoint,
    dtype=np.float32,
    include: Callable[[str], bool] = lambda name: True,
) -> dict[str, np.ndarray]:
    """Load (a subset of) an HF checkpoint as {our name: in-memory array}.

    Quantised weights are dequantised (computed in f32, then cast to `dtype`); other float tensors
    are cast to `dtype`; integer tensors keep theirs. `dtype=None` keeps stored float dtypes and
    dequantises to f32. `include(name)` sees our (output) names; excluded parameters are never read.
    Tensor by tensor from the shard memmaps, so peak memory is the outputs plus one row chunk.
    Every index tensor is consumed exactly once (pairs count both halves; spec model §2.6 step 1).
    """
    ckpt = hf_dir if isinstance(hf_dir, ShardedCheckpoint) else ShardedCheckpoint(hf_dir)
    params: dict[str, np.ndarray] = {}
    for name, plan in plan_hf_params(ckpt).items():
        if not include(name):
            continue
        out = np.empty(plan.shape, _out_dtype(plan, dtype))
        if plan.stacked:
            for e, src in enumerate(plan.sources):
                _fill(ckpt, src, out[e])  # [E, out, in]: slot e is expert e
        else:
            _fill(ckpt, plan.sources[0], out)
        params[name] = out
    return params
