"""XLA reference for fp4_pack: the formats the model already uses (``dsv41_jax.quant``), and the cache
write as the engine did it before the fused kernel: pack, then scatter by slot."""

from __future__ import annotations

import jax

from dsv41_jax import quant


def pack_nvfp4(x):
    """[..., N] -> (E2M1 nibbles uint8 [..., N/2], E4M3 scales float8_e4m3fn [..., N/16])."""
    return quant.pack_nvfp4(x)


def pack_mxfp4(x):
    """[..., N] -> (E2M1 nibbles uint8 [..., N/2], E8M0 bytes uint8 [..., N/32])."""
    return quant.pack_mxfp4(x)


def unpack_nvfp4(codes, scales, dtype):
    return quant.unpack_nvfp4(codes, scales, dtype)


def unpack_mxfp4(codes, exps, dtype):
    return quant.unpack_mxfp4(codes, exps, dtype)


def write_rows(buf, rows, index):
    """buf [B, T, ...] with rows [B, S, ...] written at ``index`` [B, S] (out of range = not written)."""
    return jax.vmap(lambda b, r, i: b.at[i].set(r, mode="drop"))(buf, rows, index)


def write_nvfp4(codes_cache, scales_cache, x, index):
    codes, scales = quant.pack_nvfp4(x)
    return write_rows(codes_cache, codes, index), write_rows(scales_cache, scales, index)


def write_mxfp4(codes_cache, exps_cache, x, index):
    codes, exps = quant.pack_mxfp4(x)
    return write_rows(codes_cache, codes, index), write_rows(exps_cache, exps, index)
