"""fp4_pack on GPU through the Pallas Triton lowering (deprecated in jax 0.11): a comparison only.

``api.py`` runs the Mosaic GPU kernels (``mosaic.py``) on GPU: on the H200 its pack is 2.6–3.4× faster than
this one and its unpack and write are within 5% (BENCHMARKS.md). These came first, when the Triton lowering
was the one whose output could be checked on a CPU-only jaxlib, and stay because ``bench.py`` times them
beside Mosaic GPU and XLA, and because ``write`` here is the one kernel that scatters rows to their cache
slots from inside (Mosaic GPU's TMA stores need rows of at least 16 bytes; an MXFP4 scale row is 4).

Triton needs power-of-two block shapes: the row tile is rounded up to one, and G, block//2 and 2 are
powers of two for both formats. The Pallas Triton lowering does not mask blocks that overhang the array
(a plain ``ref[...]`` is an unmasked pointer load), so the last row tile loads and stores with an
explicit row mask.

``unpack`` is the inverse with the same tiling. ``write`` packs a tile of new rows and scatters them
into the (aliased, so updated in place) cache: the cache is one un-blocked pointer, and each row's
store address comes from its flat slot ``b·T + index``; dropped rows are masked off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp4_pack import decode, encode, layout

_TILE_FNS = {"nvfp4": encode.nvfp4_tile, "mxfp4": encode.mxfp4_tile}


def _live(tr: int, rows: int, *shape):
    """Rows of the (possibly overhanging) last tile that exist, broadcast to [tr, *shape]."""
    return pl.program_id(0) * tr + lax.broadcasted_iota(jnp.int32, (tr, *shape), 0) < rows


def _pack_tile(x_ref, fmt: str, rows: int):
    tr, g, h, _ = x_ref.shape

    def lanes(j):  # one stride-2 load per pair member, so packing needs no lane shuffle (Triton has no
        # lowering for a value slice, and an int index on the masked ref view fails in interpret mode)
        v = pltriton.load(x_ref.at[:, :, :, pl.ds(j, 1)], mask=_live(tr, rows, g, h, 1), other=0)
        return v.reshape(tr, g, h).astype(jnp.float32)  # [tr, G, block//2]

    packed, byte = _TILE_FNS[fmt](lanes(0), lanes(1))
    return packed.astype(jnp.uint8), byte.astype(jnp.uint8)


def _kernel(x_ref, codes_ref, scales_ref, *, fmt: str, rows: int):
    tr, g, h, _ = x_ref.shape
    packed, byte = _pack_tile(x_ref, fmt, rows)
    pltriton.store(codes_ref, packed, mask=_live(tr, rows, g, h))
    pltriton.store(scales_ref, byte, mask=_live(tr, rows, g))


def _check_groups(g: int) -> None:
    if g & (g - 1):
        raise ValueError(f"fp4_pack gpu: groups per row ({g}) must be a power of two for Triton blocks")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "num_warps", "interpret"))
def pack(x, fmt: str, *, rows_per_step: int = 16, num_warps: int = 4, interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit."""
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    xp = layout.split_pairs(x, block)
    r, g, h, _ = xp.shape
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    _check_groups(g)
    tr = _pow2_at_least(min(r, rows_per_step))
    codes, scales = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, rows=r),
        out_shape=(jax.ShapeDtypeStruct((r, g, h), jnp.uint8), jax.ShapeDtypeStruct((r, g), jnp.uint8)),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0))],
        out_specs=(pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(xp)
    return layout.join(lead, codes, scales, fmt)


def _unpack_kernel(c_ref, s_ref, o_ref, *, fmt: str, rows: int):
    tr, g, h = c_ref.shape
    c = pltriton.load(c_ref, mask=_live(tr, rows, g, h), other=0).astype(jnp.int32)
    sb = pltriton.load(s_ref, mask=_live(tr, rows, g), other=0).astype(jnp.int32)
    for j, v in enumerate(decode.unpack_tile(c, sb, fmt)):  # even lanes, then odd: stride-2 stores
        pltriton.store(o_ref.at[:, :, :, pl.ds(j, 1)], v.reshape(tr, g, h, 1).astype(o_ref.dtype),
                       mask=_live(tr, rows, g, h, 1))


@functools.partial(jax.jit, static_argnames=("fmt", "dtype", "rows_per_step", "num_warps", "interpret"))
def unpack(codes, scales, fmt: str, dtype=jnp.float32, *, rows_per_step: int = 16, num_warps: int = 4,
           interpret: bool = False):
    """Packed nibbles [..., N/2] and scales [..., G] -> the ``quant.unpack_<fmt>`` values, bit for bit."""
    c, sb = layout.split_codes(codes, scales, layout.FORMATS[fmt])
    r, g, h = c.shape
    if r == 0:
        return jnp.zeros((*codes.shape[:-1], 2 * codes.shape[-1]), dtype)
    _check_groups(g)
    tr = _pow2_at_least(min(r, rows_per_step))
    out = pl.pallas_call(
        functools.partial(_unpack_kernel, fmt=fmt, rows=r),
        out_shape=jax.ShapeDtypeStruct((r, g, h, 2), dtype),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(c, sb)
    return out.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def _write_kernel(dest_ref, x_ref, _c_in, _s_in, c_ref, s_ref, *, fmt: str, rows: int, cache_rows: int):
    tr, g, h, _ = x_ref.shape
    dest = pltriton.load(dest_ref, mask=_live(tr, rows), other=cache_rows)  # [tr] flat cache rows
    ok = dest < cache_rows  # cache_rows marks "not written"; the interpreter drops it, Triton masks it
    packed, byte = _pack_tile(x_ref, fmt, rows)
    lane_g = lax.broadcasted_iota(jnp.int32, (1, g, 1), 1)
    lane_h = lax.broadcasted_iota(jnp.int32, (1, 1, h), 2)
    pltriton.store(c_ref.at[dest[:, None, None], lane_g, lane_h], packed, mask=ok[:, None, None])
    pltriton.store(s_ref.at[dest[:, None], lane_g[:, :, 0]], byte, mask=ok[:, None])


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "num_warps", "interpret"))
def write(codes_cache, scales_cache, x, index, fmt: str, *, rows_per_step: int = 16, num_warps: int = 4,
          interpret: bool = False):
    """Pack ``x`` [B, S, N] and write row (b, s) at cache slot ``index[b, s]``, the reference's
    ``.at[index].set(mode="drop")`` on [B, T, ...] caches; returns the updated (aliased) caches."""
    block = layout.FORMATS[fmt]
    b, t, _ = codes_cache.shape
    xp = layout.split_pairs(x, block)
    r, g, h, _ = xp.shape
    if r == 0:
        return codes_cache, scales_cache
    _check_groups(g)
    slot = layout.cache_slots(index, t)
    dest = jnp.where(slot < t, jnp.arange(b, dtype=jnp.int32)[:, None] * t + slot, b * t).reshape(r)
    tr = _pow2_at_least(min(r, rows_per_step))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    c, sb = pl.pallas_call(
        functools.partial(_write_kernel, fmt=fmt, rows=r, cache_rows=b * t),
        out_shape=(jax.ShapeDtypeStruct((b * t, g, h), jnp.uint8), jax.ShapeDtypeStruct((b * t, g), jnp.uint8)),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr,), lambda i: (i,)), pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0)),
                  any_spec, any_spec],
        out_specs=(any_spec, any_spec),
        input_output_aliases={2: 0, 3: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(dest, xp, codes_cache.reshape(b * t, g, h), layout.as_bytes(scales_cache).reshape(b * t, g))
    return c.reshape(codes_cache.shape), layout.from_bytes(sb.reshape(scales_cache.shape), scales_cache.dtype)
