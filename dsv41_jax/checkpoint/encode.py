"""Float parameter values -> the release's stored tensors (spec model §2.2), for ``dsv41 export``.

Scales follow the release's rule (``quant.quantize_fp8_blocks`` / ``quantize_fp4_rows``): FP8 E4M3 with an E8M0
scale 2^ceil(log2(amax / 448)) per 32x32 tile (per row and 32 columns for the Engram tables), routed experts
MXFP4, E2M1 with 2^ceil(log2(amax / 6)) per row and 32 columns. Values are rounded to nearest even.

A dequantised block does not say which scale it was stored with: a tile whose largest code was 224 at scale s
decodes to the same values as one with code 448 at s/2, and the rule picks s/2. So where the scale the
values came from is known (``hint``: a native conversion's, or that of the checkpoint a run was fine-tuned
from), it is kept for every block whose values it still encodes exactly: unchanged blocks come back byte for
byte, changed blocks follow the rule.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv41_jax import quant

__all__ = ["cast", "fp4_rows", "fp8_blocks"]

_F8, _F4 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float4_e2m1fn)


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float tensor stored as ``dtype`` (BF16 or F32): round to nearest even."""
    return np.asarray(values).astype(dtype)


def _per_value(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """[R/br, C/bc] per-block array -> [R, C] (ragged edge blocks allowed)."""
    return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def _all_per_block(ok: np.ndarray, block: tuple[int, int], blocks: tuple[int, int]) -> np.ndarray:
    """[R, C] bool -> [R/br, C/bc]: every value of the block."""
    (br, bc), (nr, nc) = block, blocks
    padded = np.ones((nr * br, nc * bc), bool)
    padded[: ok.shape[0], : ok.shape[1]] = ok
    return padded.reshape(nr, br, nc, bc).all(axis=(1, 3))


def _on_hint(values: np.ndarray, hint: np.ndarray, block: tuple[int, int], grid: np.dtype
             ) -> tuple[np.ndarray, np.ndarray]:
    """(codes on the ``grid`` dtype at the hinted scales, [blocks] where they encode ``values`` exactly)."""
    b = hint.astype(np.int32)
    scaled = np.ldexp(values, _per_value(127 - np.minimum(b, 254), values.shape, block))  # exact: powers of two
    with np.errstate(invalid="ignore", over="ignore"):
        codes = scaled.astype(grid)
        ok = codes.astype(np.float32) == scaled  # saturated or NaN codes differ too
    ok = _all_per_block(ok, block, hint.shape) & (b != 255)
    return codes, ok


def fp8_blocks(values: np.ndarray, block: tuple[int, int], hint: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """[R, C] float values -> (F8_E4M3 codes [R, C], E8M0 scale bytes [R/br, C/bc] as uint8)."""
    values = np.asarray(values, np.float32)
    q, s = (np.asarray(a) for a in quant.quantize_fp8_blocks(values, block=block))
    if hint is None:
        return q, s
    codes, ok = _on_hint(values, hint, block, _F8)
    keep = _per_value(ok, values.shape, block)
    return np.where(keep, codes, q).astype(_F8), np.where(ok, hint, s).astype(np.uint8)


def fp4_rows(values: np.ndarray, hint: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[R, C] float values -> (packed E2M1 bytes [R, C/2] as int8, low nibble = even column; E8M0 scale bytes
    [R, C/32] as uint8)."""
    values = np.asarray(values, np.float32)
    packed, s = (np.asarray(a) for a in quant.quantize_fp4_rows(values))
    if hint is None:
        return packed.view(np.int8), s
    codes, ok = _on_hint(values, hint, (1, quant.MXFP4_BLOCK), _F4)
    nibbles = codes.view(np.uint8) & 0x0F  # float4_e2m1fn's bits are the release's code: bit 3 sign
    ours = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
    keep = np.repeat(ok, quant.MXFP4_BLOCK // 2, axis=1)[:, : packed.shape[1]]
    return np.where(keep, ours, packed).view(np.int8), np.where(ok, hint, s).astype(np.uint8)
