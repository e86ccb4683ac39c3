"""fp4_pack: the main-KV (NVFP4: E2M1 + E4M3 per 16) and index-key (MXFP4: E2M1 + E8M0 per 32) cache
formats (spec attention §7.2-7.4), bit-identical to ``dsv41_jax.quant``.

- ``pack_*``: latents -> packed codes + scale bytes (``quant.pack_*``).
- ``unpack_*``: packed codes + scale bytes -> dequantised latents (``quant.unpack_*``).
- ``write_*``: the engine's cache write fused: pack new rows [B, S, N] and store row (b, s) at slot
  ``index[b, s]`` of [B, T, ...] caches (``pack`` then ``.at[index].set(mode="drop")``), in place when
  the caller donates the caches. Live slots of one sequence must be distinct, as the engine's are (one
  per closed entry): the reference leaves the winner of a duplicate unspecified.

``backend="xla"`` is the reference (always available); ``backend="pallas"`` picks the kernel for the
default platform: Mosaic GPU on GPU (``direct.py`` for pack and write, ``mosaic.py`` for unpack), Mosaic
TPU on TPU, and the TPU kernel in interpret mode on CPU (slow; for tests). The switch is an argument, not
config state: callers pass their own ``kernel_backend``.

On GPU the cache write is one kernel (``direct.write``): each thread stores its group's codes and scale
byte at the slot's address, and the caches are updated in place (jax >= 0.11; older jax packs, then
scatters with XLA). ``mosaic.pack`` (the TMA-loop pack, timed by ``bench_mosaic.py``) and ``mosaic.write``
(that pack, then XLA's scatter) stay as tested variants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped, UInt8

from pallas_kernels.fp4_pack import direct, mosaic, reference, tpu

BACKENDS = ("xla", "pallas")


def _kernels(op: str = "pack"):
    """The platform's kernel module for ``op`` and whether it must be interpreted (CPU). On GPU the pack
    and the cache write take the SMEM-less kernel (``direct``, faster on the H200: BENCHMARKS.md), the
    unpack ``mosaic``'s streaming loop."""
    platform = jax.default_backend()
    if platform == "gpu":
        return (mosaic if op == "unpack" else direct), False
    return tpu, platform != "tpu"


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"fp4_pack: backend must be one of {BACKENDS}, got {backend!r}")


def pack_nvfp4(
    x: Float[Array, "*B N"], *, backend: str = "xla"
) -> tuple[UInt8[Array, "*B N//2"], Shaped[Array, "*B N//16"]]:
    """x -> (E2M1 nibbles uint8, E4M3 scales float8_e4m3fn); 288 B per 512 lanes (main KV)."""
    _check(backend)
    if backend == "xla":
        return reference.pack_nvfp4(x)
    mod, interpret = _kernels()
    return mod.pack(x, "nvfp4", interpret=interpret)


def pack_mxfp4(
    x: Float[Array, "*B N"], *, backend: str = "xla"
) -> tuple[UInt8[Array, "*B N//2"], UInt8[Array, "*B N//32"]]:
    """x -> (E2M1 nibbles uint8, E8M0 exponent bytes uint8); 68 B per 128 lanes (index keys)."""
    _check(backend)
    if backend == "xla":
        return reference.pack_mxfp4(x)
    mod, interpret = _kernels()
    return mod.pack(x, "mxfp4", interpret=interpret)


def unpack_nvfp4(codes: UInt8[Array, "*B H"], scales: Shaped[Array, "*B G"], dtype=jnp.float32, *,
                 backend: str = "xla") -> Float[Array, "*B 2*H"]:
    """(E2M1 nibbles, E4M3 scales) -> values in ``dtype`` (exact: every code x scale fits bf16, spec §7)."""
    _check(backend)
    if backend == "xla":
        return reference.unpack_nvfp4(codes, scales, dtype)
    mod, interpret = _kernels("unpack")
    return mod.unpack(codes, scales, "nvfp4", dtype, interpret=interpret)


def unpack_mxfp4(codes: UInt8[Array, "*B H"], exps: UInt8[Array, "*B G"], dtype=jnp.float32, *,
                 backend: str = "xla") -> Float[Array, "*B 2*H"]:
    """(E2M1 nibbles, E8M0 bytes) -> values in ``dtype``."""
    _check(backend)
    if backend == "xla":
        return reference.unpack_mxfp4(codes, exps, dtype)
    mod, interpret = _kernels("unpack")
    return mod.unpack(codes, exps, "mxfp4", dtype, interpret=interpret)


def write_nvfp4(codes_cache: UInt8[Array, "B T H"], scales_cache: Shaped[Array, "B T G"],
                x: Float[Array, "B S 2*H"], index: Int[Array, "B S"], *, backend: str = "xla"
                ) -> tuple[UInt8[Array, "B T H"], Shaped[Array, "B T G"]]:
    """Main-KV caches with ``pack_nvfp4(x)[b, s]`` written at slot ``index[b, s]`` (out of range: dropped)."""
    _check(backend)
    if backend == "xla":
        return reference.write_nvfp4(codes_cache, scales_cache, x, index)
    mod, interpret = _kernels()
    return mod.write(codes_cache, scales_cache, x, index, "nvfp4", interpret=interpret)


def write_mxfp4(codes_cache: UInt8[Array, "B T H"], exps_cache: UInt8[Array, "B T G"],
                x: Float[Array, "B S 2*H"], index: Int[Array, "B S"], *, backend: str = "xla"
                ) -> tuple[UInt8[Array, "B T H"], UInt8[Array, "B T G"]]:
    """Index-key caches with ``pack_mxfp4(x)[b, s]`` written at slot ``index[b, s]`` (out of range: dropped)."""
    _check(backend)
    if backend == "xla":
        return reference.write_mxfp4(codes_cache, exps_cache, x, index)
    mod, interpret = _kernels()
    return mod.write(codes_cache, exps_cache, x, index, "mxfp4", interpret=interpret)
