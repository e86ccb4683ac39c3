"""What a conversion writes: the source checked against the config's inventory, one ``Output`` per array,
and the values of any band of rows of an output (spec model §2.2, §2.4, §2.6).

Parameter names are the checkpoint's own (spec model §2.8), HF aliases normalised (§2.6 step 3), routed
experts stacked on a leading axis [E, out, in]. Weights modes: ``fp32`` / ``bf16`` dequantise FP8 and FP4
(exact in both dtypes) and keep F32 tensors in F32; ``native`` keeps FP8 weights, packed FP4 experts and
their E8M0 scales (as uint8 bytes) as stored, except ``attn.wo_a``, which the reference dequantises to
bf16 at load (spec model §2.5, §2.6 step 6) and so do we: the model applies it as a grouped einsum. Its
source scale is kept beside it (``attn.wo_a.scale``, unused by the model): ``dsv41 export`` re-encodes the
bf16 values with it, so the FP8 bytes come back as they were (a dequantised tile alone does not say which
of two power-of-two scales it was stored with).

A bf16 export (``dsv41 export --weights bf16``: no ``quantization_config``, every quantised weight one BF16
tensor, no scales; ``inventory.dequantised``) converts too: ``bf16`` / ``fp32`` read its values as they are,
``native`` encodes them by the release's rules (``encode``). A dequantised release block encodes back onto the
same values (an E4M3 or E2M1 grid times a smaller power of two is still on the grid), so release -> export bf16
-> convert native holds the values the release holds, though a scale byte may be the rule's, not the source's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dsv41_jax import config as C
from dsv41_jax.checkpoint import hf
from dsv41_jax.checkpoint.inventory import TensorSpec, dequantised, expected_inventory
from dsv41_jax.checkpoint.safetensors import SafetensorsError, ShardedCheckpoint

__all__ = ["MODES", "ConvertError", "Output", "bands", "chunk_shape", "config_outputs", "plan_outputs", "produce",
           "validate_source"]

MODES = ("native", "bf16", "fp32")
_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w\d)\.(?P<part>weight|scale)$")
_U8, _F8 = np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn)
_BF16, _F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


class ConvertError(ValueError):
    """The source checkpoint is incomplete or disagrees with its config, or the output is in the way."""


@dataclass(frozen=True)
class Output:
    """One array of the Orbax tree and how to produce it from the source tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    decode: str  # "raw" (copy / exact cast), "fp8" (E4M3 x E8M0 block), "fp4" (packed E2M1 x E8M0), or
    # "encode-fp8" / "encode-fp4": the codes (or, for a ``.scale`` output, the scales) of float source values
    sources: tuple[str, ...]  # source (index) names; one per expert when stacked
    scales: tuple[str, ...] = ()  # their scale tensors, for fp8 / fp4
    block: tuple[int, int] = (1, 1)  # scale block (rows, columns)
    src_bytes: int = 0  # source bytes consumed, for progress
    stacked: bool = False  # routed experts: axis 0 is the expert, source i feeds slot i

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# ----------------------------------------------------------------------------- validation


def _found(ckpt: ShardedCheckpoint) -> dict[str, str]:
    """{canonical name: index name} of the source, DSpark's embed/head copies dropped (spec model §2.6)."""
    found: dict[str, str] = {}
    for name in ckpt.keys():
        c = hf.canonical_name(name)
        if hf._DROPPED.match(c):
            continue
        if c in found:
            raise ConvertError(f"{ckpt.dir}: {found[c]!r} and {name!r} both mean {c!r}; the index mixes name schemes")
        found[c] = name
    return found


def _listing(title: str, items: list[str], limit: int = 20) -> list[str]:
    if not items:
        return []
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return [f"{title} ({len(items)}): " + ", ".join(items[:limit]) + more]


def validate_source(ckpt: ShardedCheckpoint, cfg: C.ModelConfig, quantised: bool = True) -> dict[str, str]:
    """Check every tensor's name, dtype and shape against the config's inventory (headers only); that of a
    bf16 export when not ``quantised``.

    Returns {canonical name: index name}. Raises ConvertError listing every missing, unexpected and
    mismatched tensor by name, so a partial download or a wrong config.json is found before any data moves.
    """
    try:
        ckpt.validate()  # every shard present, index and headers agree (truncation shows up here)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from e
    found = _found(ckpt)
    inventory = expected_inventory(cfg)
    expected = {t.name: t for t in (inventory if quantised else dequantised(inventory))}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(found[c] for c in set(found) - set(expected))
    wrong = []
    for c in sorted(set(found) & set(expected)):
        info, want = ckpt.info(found[c]), expected[c]
        if (info.dtype, tuple(info.shape)) != (want.dtype, want.shape):
            wrong.append(f"{found[c]} is {info.dtype}{list(info.shape)}, config implies {want.dtype}{list(want.shape)}")
    lines = _listing("missing", missing) + _listing("unexpected", unexpected) + _listing("dtype/shape", wrong)
    if lines:
        raise ConvertError(
            f"{ckpt.dir}: the checkpoint does not match its config.json ({len(missing) + len(unexpected) + len(wrong)}"
            " tensor(s)):\n  " + "\n  ".join(lines) + "\nA partial download shows as missing tensors; a config.json "
            "of another model size as dtype/shape mismatches; a renamed tensor as missing + unexpected; BF16 "
            "weights without scales under a config.json with a quantization_config (or FP8 ones under one without) "
            "as dtype/shape mismatches with missing or unexpected scales.")
    total = ckpt.metadata.get("total_size")
    have = sum(ckpt.info(n).nbytes for n in ckpt.keys())
    if total is not None and int(total) != have:
        raise ConvertError(f"{ckpt.dir}: index metadata.total_size is {int(total):,} bytes but the shards hold "
                           f"{have:,}; the index belongs to another download")
    return found


# ----------------------------------------------------------------------------- planning


def _pairs(inventory: list[TensorSpec]) -> Iterator[tuple[str, list[TensorSpec], list[TensorSpec], bool]]:
    """(our name, weights, scales, stacked) in inventory order: quantised pairs joined, each routed-expert
    family (``P.ffn.experts.{E}.wK``) stacked in numeric expert order."""
    by_name = {t.name: t for t in inventory}
    groups: dict[str, list[tuple[int, TensorSpec, TensorSpec | None]]] = {}
    for t in inventory:
        if t.name.endswith(".scale"):
            continue
        scale = by_name.get(t.name[: -len("weight")] + "scale") if t.name.endswith(".weight") else None
        m = _EXPERT.match(t.name)
        key = f"{m['prefix']}.{m['w']}.weight" if m else t.name
        groups.setdefault(key, []).append((int(m["e"]) if m else -1, t, scale))
    for key, members in groups.items():
        members.sort(key=lambda x: x[0])  # expert 10 after 9, not after 1
        yield key, [t for _, t, _ in members], [s for _, _, s in members if s], members[0][0] >= 0


def _float_dtype(stored: str, mode: str) -> np.dtype:
    if stored == "F32" or mode == "fp32":
        return _F32  # F32 tensors (mHC, sinks, router biases) stay F32 in every mode (spec model §2.5)
    return _BF16


def _from_dequantised(name: str, ws: list[TensorSpec], ss: list[TensorSpec], stacked: bool, mode: str,
                      srcs: tuple[str, ...]) -> list[Output]:
    """A quantised pair's outputs read from a bf16 export's one BF16 tensor per weight (see the module docstring)."""
    w, lead = ws[0], ((len(ws),) if stacked else ())
    fp4 = w.dtype == "I8"
    shape = (w.shape[0], 2 * w.shape[1]) if fp4 else w.shape
    block = (1, 32) if fp4 or ".engram.embed." in name else (32, 32)  # spec model §2.2
    bytes_v = 2 * math.prod(shape) * len(ws)
    if mode != "native":
        return [Output(name, lead + shape, _float_dtype("BF16", mode), "raw", srcs, src_bytes=bytes_v, stacked=stacked)]
    kind = "encode-fp4" if fp4 else "encode-fp8"
    scale = Output(name[: -len("weight")] + "scale", lead + ss[0].shape, _U8, kind, srcs, block=block, stacked=stacked)
    if name.endswith("attn.wo_a.weight"):  # bf16 in every mode (spec model §2.5), the rule's scale beside it
        return [Output(name, lead + shape, _BF16, "raw", srcs, src_bytes=bytes_v), scale]
    return [Output(name, lead + w.shape, _U8 if fp4 else _F8, kind, srcs, (), block, bytes_v, stacked), scale]


def _outputs_for(name: str, ws: list[TensorSpec], ss: list[TensorSpec], stacked: bool, mode: str,
                 src: Mapping[str, str], quantised: bool = True) -> list[Output]:
    w = ws[0]
    lead = (len(ws),) if stacked else ()
    srcs = tuple(src[t.name] for t in ws)
    bytes_w = sum(t.nbytes for t in ws)
    if not ss:
        return [Output(name, lead + w.shape, _float_dtype(w.dtype, mode), "raw", srcs, src_bytes=bytes_w)]
    if not quantised:
        return _from_dequantised(name, ws, ss, stacked, mode, srcs)
    scales = tuple(src[t.name] for t in ss)
    bytes_s = sum(t.nbytes for t in ss)
    fp4 = w.dtype == "I8"
    keep = mode == "native" and not name.endswith("attn.wo_a.weight")
    if keep:  # stored bytes as they are; E8M0 scales and FP4 codes as uint8
        scale_name = name[: -len("weight")] + "scale"
        return [Output(name, lead + w.shape, _U8 if fp4 else _F8, "raw", srcs, src_bytes=bytes_w, stacked=stacked),
                Output(scale_name, lead + ss[0].shape, _U8, "raw", scales, src_bytes=bytes_s, stacked=stacked)]
    shape = (w.shape[0], 2 * w.shape[1]) if fp4 else w.shape
    block = (1, 32) if fp4 or ".engram.embed." in name else (32, 32)  # spec model §2.2
    dtype = _BF16 if mode == "native" else _float_dtype("BF16", mode)
    out = Output(name, lead + shape, dtype, "fp4" if fp4 else "fp8", srcs, scales, block, bytes_w + bytes_s, stacked)
    if mode != "native":
        return [out]
    scale_name = name[: -len("weight")] + "scale"  # wo_a: the source's scale, for export
    return [out, Output(scale_name, lead + ss[0].shape, _U8, "raw", scales, stacked=stacked)]


def config_outputs(cfg: C.ModelConfig, mode: str, src: Mapping[str, str] | None = None, quantised: bool = True
                   ) -> list[Output]:
    """The output arrays of ``cfg``'s checkpoint in weights ``mode`` (from the config alone; ``src`` maps
    canonical to index names when the source spells them differently; not ``quantised``: from a bf16 export)."""
    if mode not in MODES:
        raise ConvertError(f"--weights {mode!r}: choose one of {', '.join(MODES)}")
    inventory = expected_inventory(cfg)
    src = src or {t.name: t.name for t in inventory}
    return [o for name, ws, ss, stacked in _pairs(inventory)
            for o in _outputs_for(name, ws, ss, stacked, mode, src, quantised)]


def plan_outputs(ckpt: ShardedCheckpoint, cfg: C.ModelConfig, mode: str, quantised: bool = True) -> list[Output]:
    """Every output array of a conversion, after validating the source against ``cfg`` (and, when not
    ``quantised``, against the bf16 export's inventory)."""
    if mode not in MODES:
        raise ConvertError(f"--weights {mode!r}: choose one of {', '.join(MODES)}")
    outs = config_outputs(cfg, mode, validate_source(ckpt, cfg, quantised), quantised)
    return sorted(outs, key=lambda o: (ckpt.shard_of(o.sources[0]), o.name))  # shard by shard: file locality


# ----------------------------------------------------------------------------- producing bands


def _dequant(out: Output, ckpt: ShardedCheckpoint, i: int, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of source ``i``, dequantised in f32 (spec model §2.2).

    A power-of-two scaling of an E4M3 / E2M1 value: exact in f32, and exact in bf16 too (3 mantissa bits
    fit in 7) unless it falls below bf16's subnormal range. NaN scales (byte 255) give NaN, as in the
    reference; a product past the f32 range gives inf.
    """
    br, bc = out.block
    raw = ckpt.read_rows(out.sources[i], r0, r1)
    vals = hf._decode_fp4(raw) if out.decode == "fp4" else raw.astype(np.float32)
    s = hf._scale_f32(ckpt.read_rows(out.scales[i], r0 // br, -(-r1 // br)))
    s = s[np.arange(r0, r1) // br - r0 // br]  # one scale row per value row
    cols = vals.shape[1]
    with np.errstate(over="ignore"):
        if cols % bc == 0 and s.shape[1] == cols // bc:
            vals.reshape(len(vals), s.shape[1], bc)[...] *= s[:, :, None]
        else:  # ragged last block
            vals *= np.repeat(s, bc, axis=1)[:, :cols]
    return vals


def _encoded(out: Output, ckpt: ShardedCheckpoint, i: int, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of the codes, or of the scales for a ``.scale`` output, that encode float source ``i`` by
    the release's rules; whole scale blocks are read and encoded, so a band may start inside one."""
    from dsv41_jax.checkpoint import encode

    br, n = out.block[0], ckpt.info(out.sources[i]).shape[0]
    is_scale = out.name.endswith(".scale")
    v0, v1 = (r0 * br, min(r1 * br, n)) if is_scale else (r0 // br * br, min(-(-r1 // br) * br, n))
    values = ckpt.read_rows(out.sources[i], v0, v1).astype(np.float32)
    codes, scales = encode.fp4_rows(values) if out.decode == "encode-fp4" else encode.fp8_blocks(values, out.block)
    return scales if is_scale else codes.view(out.dtype)[r0 - v0: r1 - v0]


def _rows(out: Output, ckpt: ShardedCheckpoint, i: int, r0: int, r1: int) -> np.ndarray:
    if out.decode.startswith("encode"):
        return _encoded(out, ckpt, i, r0, r1)
    if out.decode == "raw":
        a = ckpt.read_rows(out.sources[i], r0, r1)
        return a.view(out.dtype) if a.dtype.itemsize == 1 == out.dtype.itemsize else a.astype(out.dtype)
    return _dequant(out, ckpt, i, r0, r1).astype(out.dtype)


def produce(out: Output, ckpt: ShardedCheckpoint, region: tuple[slice, ...]) -> np.ndarray:
    """The values of ``out[region]``; ``region`` covers leading dims only (the rest is whole)."""
    inner = out.shape[1:] if out.stacked else out.shape
    if out.stacked:
        experts = region[0] if region else slice(0, out.shape[0])
        rows = region[1] if len(region) > 1 else slice(0, inner[0])
        return np.stack([_rows(out, ckpt, e, rows.start, rows.stop) for e in range(experts.start, experts.stop)])
    rows = region[0] if region else slice(0, inner[0])
    if len(inner) == 1:
        return _rows(out, ckpt, 0, 0, inner[0])[rows]
    return _rows(out, ckpt, 0, rows.start, rows.stop)


def _rows_per_chunk(fit: int, block: int, sharded: bool) -> int:
    """At most ``fit`` rows: a multiple of 32 (FP8 scale blocks) where possible; a divisor of the shard
    extent ``block`` when the dimension is sharded, so that no chunk straddles two shards."""
    fit = min(fit, block)
    if not sharded:
        return fit // 32 * 32 if fit >= 32 else fit
    divisors = [k for k in range(1, fit + 1) if block % k == 0] if fit < 4096 else \
        sorted({d for i in range(1, math.isqrt(block) + 1) if block % i == 0 for d in (i, block // i) if d <= fit})
    aligned = [k for k in divisors if k % 32 == 0]
    return (aligned or divisors)[-1]


def chunk_shape(shape: tuple[int, ...], itemsize: int, budget: int, block: tuple[int, ...] | None = None
                ) -> tuple[int, ...]:
    """zarr chunk: the mesh shard ``block`` (default: the whole array), leading dims cut until a band of
    full trailing dims fits ``budget`` bytes."""
    chunk = list(block or shape)
    for d in range(len(shape) - 1):  # the last dim is never cut: a row is the smallest band
        trailing = math.prod(shape[d + 1:]) * itemsize
        if chunk[d] * trailing <= budget:
            break
        fit = budget // trailing
        if fit >= 1:
            chunk[d] = _rows_per_chunk(fit, chunk[d], chunk[d] < shape[d])
            break
        chunk[d] = 1
    return tuple(chunk)


def bands(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
    """Regions over leading dims, each a whole number of chunks, trailing dims whole."""
    cut = [d for d in range(len(shape) - 1) if chunks[d] < shape[d]]
    depth = cut[-1] + 1 if cut else 0
    grids = [range(0, shape[d], chunks[d]) for d in range(depth)]

    def rec(d: int, acc: tuple[slice, ...]) -> Iterator[tuple[slice, ...]]:
        if d == depth:
            yield acc
            return
        for start in grids[d]:
            yield from rec(d + 1, acc + (slice(start, min(start + chunks[d], shape[d])),))

    yield from rec(0, ())
