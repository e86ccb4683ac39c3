"""XLA reference for fp4_pack: the formats the model already uses (``dsv41_jax.quant``)."""

from __future__ import annotations

from dsv41_jax import quant


def pack_nvfp4(x):
    """[..., N] -> (E2M1 nibbles uint8 [..., N/2], E4M3 scales float8_e4m3fn [..., N/16])."""
    return quant.pack_nvfp4(x)


def pack_mxfp4(x):
    """[..., N] -> (E2M1 nibbles uint8 [..., N/2], E8M0 bytes uint8 [..., N/32])."""
    return quant.pack_mxfp4(x)
