"""fp4_pack: latents -> packed main-KV (NVFP4: E2M1 + E4M3 per 16) and index-key (MXFP4: E2M1 + E8M0
per 32) formats (spec attention §7.2-7.4), bit-identical to ``dsv41_jax.quant.pack_nvfp4/pack_mxfp4``.

``backend="xla"`` is the reference (always available); ``backend="pallas"`` picks the kernel for the
default platform: Triton on GPU, Mosaic TPU on TPU, and the TPU kernel in interpret mode on CPU (slow;
for tests). The switch is an argument, not config state: callers pass their own ``kernel_backend``.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Shaped, UInt8

from pallas_kernels.fp4_pack import gpu, reference, tpu

BACKENDS = ("xla", "pallas")


def _pallas(x, fmt: str):
    platform = jax.default_backend()
    if platform == "gpu":
        return gpu.pack(x, fmt)
    return tpu.pack(x, fmt, interpret=platform != "tpu")


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"fp4_pack: backend must be one of {BACKENDS}, got {backend!r}")


def pack_nvfp4(
    x: Float[Array, "*B N"], *, backend: str = "xla"
) -> tuple[UInt8[Array, "*B N//2"], Shaped[Array, "*B N//16"]]:
    """x -> (E2M1 nibbles uint8, E4M3 scales float8_e4m3fn); 288 B per 512 lanes (main KV)."""
    _check(backend)
    return reference.pack_nvfp4(x) if backend == "xla" else _pallas(x, "nvfp4")


def pack_mxfp4(
    x: Float[Array, "*B N"], *, backend: str = "xla"
) -> tuple[UInt8[Array, "*B N//2"], UInt8[Array, "*B N//32"]]:
    """x -> (E2M1 nibbles uint8, E8M0 exponent bytes uint8); 68 B per 128 lanes (index keys)."""
    _check(backend)
    return reference.pack_mxfp4(x) if backend == "xla" else _pallas(x, "mxfp4")
