"""fp4_pack on TPU through Mosaic TPU (``pltpu``); runs on CPU with ``interpret=True``.

``pack``: one grid step quantises ``rows_per_step`` rows: read the latents once, write nibbles and scale
bytes once (the floor is bytes moved / copy bandwidth). The input arrives as [R, G, block//2, 2] so the
even and odd lanes of each pair are separate operands and packing needs no lane shuffle. ``unpack`` is
the inverse with the same tiling. ``write`` packs a chunk of new rows and DMAs each one into its cache
slot (the slots arrive by scalar prefetch; the cache is aliased, so it is updated in place).

Untested on TPU hardware: the trailing pair axis of 2 occupies a full lane tile on Mosaic TPU, so a
TPU-tuned version should load [tr, N] and de-interleave with strided lane loads; the arithmetic in
``encode`` carries over unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fp4_pack import decode, encode, layout

_TILE_FNS = {"nvfp4": encode.nvfp4_tile, "mxfp4": encode.mxfp4_tile}


def _kernel(x_ref, codes_ref, scales_ref, *, fmt: str):
    x = x_ref[...].astype(jnp.float32)  # [tr, G, block//2, 2]
    packed, byte = _TILE_FNS[fmt](x[..., 0], x[..., 1])
    codes_ref[...] = packed.astype(jnp.uint8)
    scales_ref[...] = byte.astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "interpret"))
def pack(x, fmt: str, *, rows_per_step: int = 256, interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit."""
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    xp = layout.split_pairs(x, block)
    r, g, h, _ = xp.shape
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    tr = layout.row_tile(r, rows_per_step)
    codes, scales = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt),
        out_shape=(jax.ShapeDtypeStruct((r, g, h), jnp.uint8), jax.ShapeDtypeStruct((r, g), jnp.uint8)),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0))],
        out_specs=(pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(xp)
    return layout.join(lead, codes, scales, fmt)


def _unpack_kernel(c_ref, s_ref, o_ref, *, fmt: str):
    even, odd = decode.unpack_tile(c_ref[...].astype(jnp.int32), s_ref[...].astype(jnp.int32), fmt)
    o_ref[...] = jnp.stack([even, odd], axis=-1).astype(o_ref.dtype)  # [tr, G, block//2, 2]


@functools.partial(jax.jit, static_argnames=("fmt", "dtype", "rows_per_step", "interpret"))
def unpack(codes, scales, fmt: str, dtype=jnp.float32, *, rows_per_step: int = 256, interpret: bool = False):
    """Packed nibbles [..., N/2] and scales [..., G] -> the ``quant.unpack_<fmt>`` values, bit for bit."""
    block = layout.FORMATS[fmt]
    c, sb = layout.split_codes(codes, scales, block)
    r, g, h = c.shape
    if r == 0:
        return jnp.zeros((*codes.shape[:-1], 2 * codes.shape[-1]), dtype)
    tr = layout.row_tile(r, rows_per_step)
    out = pl.pallas_call(
        functools.partial(_unpack_kernel, fmt=fmt),
        out_shape=jax.ShapeDtypeStruct((r, g, h, 2), dtype),
        grid=(pl.cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, g, h), lambda i: (i, 0, 0)), pl.BlockSpec((tr, g), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((tr, g, h, 2), lambda i: (i, 0, 0, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(c, sb)
    return out.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def _write_kernel(slot_ref, x_ref, _c_in, _s_in, c_hbm, s_hbm, c_buf, s_buf, *, fmt: str, length: int):
    b, j = pl.program_id(0), pl.program_id(1)
    ts, n = x_ref.shape[1], slot_ref.shape[1]
    x = x_ref[0].astype(jnp.float32)  # [ts, G, block//2, 2]
    packed, byte = _TILE_FNS[fmt](x[..., 0], x[..., 1])
    c_buf[...] = packed.astype(jnp.uint8)
    s_buf[...] = byte.astype(jnp.uint8)

    def row(i, carry):  # one DMA per row: its slot is arbitrary (positions, not a contiguous range)
        s = j * ts + i
        slot = slot_ref[b, jnp.minimum(s, n - 1)]

        @pl.when((s < n) & (slot < length))  # the last tile's overhang and dropped rows write nothing
        def _():
            pltpu.sync_copy(c_buf.at[i], c_hbm.at[b, slot])
            pltpu.sync_copy(s_buf.at[i], s_hbm.at[b, slot])

        return carry

    lax.fori_loop(0, ts, row, 0)


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "interpret"))
def write(codes_cache, scales_cache, x, index, fmt: str, *, rows_per_step: int = 64, interpret: bool = False):
    """Pack ``x`` [B, S, N] and write row (b, s) at cache slot ``index[b, s]``, the reference's
    ``.at[index].set(mode="drop")`` on [B, T, ...] caches; returns the updated (aliased) caches."""
    block = layout.FORMATS[fmt]
    (b, t, _), (_, s, n) = codes_cache.shape, x.shape
    g, h = n // block, block // 2
    if b * s == 0:
        return codes_cache, scales_cache
    xp = layout.split_pairs(x, block).reshape(b, s, g, h, 2)
    c = codes_cache.reshape(b, t, g, h)
    sb = layout.as_bytes(scales_cache)
    ts = layout.row_tile(s, rows_per_step)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b, pl.cdiv(s, ts)),
        in_specs=[pl.BlockSpec((1, ts, g, h, 2), lambda i, j, _: (i, j, 0, 0, 0)), any_spec, any_spec],
        out_specs=(any_spec, any_spec),
        scratch_shapes=[pltpu.VMEM((ts, g, h), jnp.uint8), pltpu.VMEM((ts, g), jnp.uint8)])
    c, sb = pl.pallas_call(
        functools.partial(_write_kernel, fmt=fmt, length=t),
        out_shape=(jax.ShapeDtypeStruct(c.shape, jnp.uint8), jax.ShapeDtypeStruct(sb.shape, jnp.uint8)),
        grid_spec=grid_spec,
        input_output_aliases={2: 0, 3: 1},  # operand 0 is the prefetched slots
        # live slots are distinct (one per closed entry), so no two steps write the same cache row
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(layout.cache_slots(index, t), xp, c, sb)
    return c.reshape(codes_cache.shape), layout.from_bytes(sb, scales_cache.dtype)
