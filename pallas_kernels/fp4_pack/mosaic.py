"""fp4_pack on GPU through Mosaic GPU (``plgpu.kernel``), the supported Pallas GPU path in jax 0.11.

Streaming: each CTA runs ``mosaic_stream.stream`` over row tiles (TMA in with ``stages`` slots, TMA out
from two buffers), so loads, the encode and stores of consecutive tiles overlap. Bit-identical to
``quant.pack_nvfp4`` / ``pack_mxfp4``; no fp4/fp8 casts (Mosaic GPU has them on Blackwell only) and no
float divide. ``api`` packs through ``direct.pack`` on GPU now (the same encode without the SMEM loop,
faster on the H200); this module's pack is the TMA-loop variant, and its unpack is the GPU default.

Per element the encode is 7 compares of |x| with per-group thresholds (``thresholds``: exact, and
checked exhaustively against the reference), instead of ``encode``'s ~90 integer ops of long division
and bit rounding, which would make the kernel ALU-bound far above its byte floor. The per-group work
(amax, the E4M3 / E8M0 scale with ``encode``'s exact integer routines, 7 products) runs once per group:
in the default ``rows`` register layout a thread owns whole groups ([groups, pairs] with one row per
thread, ``mosaic_stream.rows_layout``), so the group max and the threshold broadcast stay in registers.
``layout_name="wgmma"`` (the WGMMA layout, 4 lanes per group, shuffles for the max) is kept as a fallback
variant. The encodes and the kernel input view are ``mosaic_encode``'s, shared with ``direct``.

Pairs without lane shuffles (element 2i goes in the low nibble of byte i):

* bf16 input: a pair of lanes is one 32-bit word (free ``bitcast_convert_type`` of [..., 2] bf16),
  low half = even lane; even = word << 16, odd = word & 0xFFFF0000 as fp32 bits (exact). The kernel
  reads the input once: the fast path, and the cache-write dtype.
* f32 (and other) input: a pair is 64 bits, which no 32-bit register type holds and Mosaic GPU's
  layouts cannot split out of a vector register, so XLA first transposes each group's fp32 bit
  patterns to [evens | odds] (one extra read + write of the input); the kernel loads the halves.

TMA boxes need an innermost extent of >= 16 bytes and <= 256 elements per dimension, which shapes the
GMEM views: input [R, G, P] words (or [R, G, 2, P]), codes [R, N/2] bytes (or [R, N/512, 256]), scales
[R, G] bytes when G is a multiple of 16, else flat [R * G] bytes stored in 256-byte pieces. The last
row tile overhangs R: TMA zero-fills its loads and drops its stores, except for the flat scale view, which
is padded to whole tiles (an overhanging 1-D piece wrote wrong scale bytes on the H200; padded, the 3- and
4099-row MXFP4 cases are exact there).

The module also holds ``unpack`` (the inverse, same streaming loop; the GPU default) and ``write`` (pack,
then XLA's scatter of the packed rows; the GPU write is ``direct.write``, one kernel).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms
from pallas_kernels.fp4_pack import decode, layout, reference
from pallas_kernels.fp4_pack.mosaic_encode import ENCODES, HI_HALF, encode_tile, to_kernel_input

_SMEM_BYTES = 232448  # per CTA on the H100 / H200 (227 KB)
_SCALE_PIECE = 256  # bytes per TMA store of the flat scale view (the TMA box limit), else 128

LAYOUTS = ("rows", "wgmma")
_ROWS_PER_LAYOUT_TILE = {"rows": 128, "wgmma": 64}


class _Geometry:
    """Static shapes of one call: GMEM views, tile sizes and their checks."""

    def __init__(self, r: int, n: int, fmt: str, split: bool, rows_per_step: int, chunk: int, lay: str,
                 encode: str = "compare"):
        block = layout.FORMATS[fmt]
        self.r, self.n, self.fmt, self.split, self.layout, self.encode = r, n, fmt, split, lay, encode
        self.g, self.p = n // block, block // 2
        self.br = min(rows_per_step, 256)
        self.bm = self.br * self.g  # groups per tile
        unit = _ROWS_PER_LAYOUT_TILE.get(lay, 128)
        self.chunk = max((c for c in range(unit, min(chunk, self.bm) + 1, unit) if self.bm % c == 0), default=chunk)
        half = n // 2
        self.codes_view = (r, half) if half <= 256 else (r, half // 256, 256)
        self.scales_2d = self.g % 16 == 0
        problems = []
        if lay not in LAYOUTS:
            problems.append(f"layout must be one of {LAYOUTS}")
        if encode not in ENCODES:
            problems.append(f"encode must be one of {ENCODES}")
        elif encode == "swar" and split:
            problems.append("encode='swar' needs bf16 input (two lanes per 32-bit word)")
        if half % 16 or (half > 256 and half % 256):
            problems.append(f"N/2 ({half}) must be a multiple of 16 (TMA rows of whole 16 bytes) and at most 256 "
                            "or a multiple of 256")
        if self.g > 256:
            problems.append(f"groups per row ({self.g}) must be <= 256 (TMA box)")
        if self.chunk % unit or self.bm % self.chunk:
            problems.append(f"chunk ({self.chunk}) must be a multiple of {unit} dividing the groups per tile "
                            f"({self.bm})")
        if self.bm % 128:  # a tile's scale buffer holds bm bytes; TMA wants 128-byte aligned SMEM
            problems.append(f"groups per tile ({self.bm} = rows_per_step x {self.g}) must be a multiple of 128")
        if problems:
            raise ValueError(f"fp4_pack mosaic ({fmt}, N={n}, rows_per_step={rows_per_step}, chunk={chunk}, "
                             f"layout={lay}): " + "; ".join(problems))
        self.n_tiles = -(-r // self.br)
        self.rows_out = r
        # the flat scale view is written in 1-D pieces: on the H200 a piece that overhangs the array's end
        # wrote wrong bytes (3 and 4099 MXFP4 rows, 2026-12-01), so that view is padded to whole tiles
        self.scale_rows = r if self.scales_2d else self.n_tiles * self.br
        self.scales_view = (r, self.g) if self.scales_2d else (self.scale_rows * self.g,)

    def pad_outputs(self):
        """Interpret mode drops a partially out-of-bounds store where TMA clips it: interpreted outputs are
        padded to whole tiles (and sliced by the caller)."""
        self.rows_out = self.scale_rows = self.n_tiles * self.br
        self.codes_view = (self.rows_out, *self.codes_view[1:])
        self.scales_view = (self.rows_out, self.g) if self.scales_2d else (self.rows_out * self.g,)

    @property
    def in_block(self):
        return (self.br, self.g, 2, self.p) if self.split else (self.br, self.g, self.p)

    @property
    def codes_block(self):
        return (self.br, *self.codes_view[1:])

    @property
    def scales_block(self):
        return (self.br, self.g) if self.scales_2d else (self.bm,)

    def reg_layout(self):
        return ms.rows_layout(self.p) if self.layout == "rows" else plgpu.Layout.WGMMA


def _kernel_body(geo: _Geometry, interpret: bool, n_ctas: int, stages: int):
    rows = functools.partial(pl.ds, size=geo.br)

    def encode(w, bcast):
        return encode_tile(geo.fmt, w, bcast, split=geo.split, encode=geo.encode)

    def body(x_gmem, codes_gmem, scales_gmem, x_buf, c_buf, s_buf, barrier):
        def load(t, slot):
            plgpu.copy_gmem_to_smem(x_gmem.at[rows(t * geo.br)], x_buf.at[slot], barrier.at[slot])

        def store(t, buf):
            plgpu.copy_smem_to_gmem(c_buf.at[buf], codes_gmem.at[rows(t * geo.br)], commit_group=False)
            if geo.scales_2d:
                plgpu.copy_smem_to_gmem(s_buf.at[buf], scales_gmem.at[rows(t * geo.br)])
                return
            size = min(geo.bm, _SCALE_PIECE if geo.bm % _SCALE_PIECE == 0 else 128)  # bm is a multiple of 128
            pieces = geo.bm // size
            for i in range(pieces):
                plgpu.copy_smem_to_gmem(s_buf.at[buf, pl.ds(i * size, size)],
                                        scales_gmem.at[pl.ds(t * geo.bm + i * size, size)],
                                        commit_group=i == pieces - 1)

        def compute_interpreted(slot, buf):  # whole tile, value reshapes (no ref reshapes or layouts there)
            x = x_buf[slot]
            w = ((x[:, :, 0].reshape(geo.bm, geo.p), x[:, :, 1].reshape(geo.bm, geo.p)) if geo.split
                 else x.reshape(geo.bm, geo.p))
            packed, byte = encode(w, lambda v: lax.broadcast_in_dim(v, (geo.bm, geo.p), (0,)))
            c_buf[buf] = packed.reshape(c_buf.shape[1:])
            s_buf[buf] = byte.reshape(s_buf.shape[1:])

        def compute(t, slot, buf):
            del t
            if interpret:
                compute_interpreted(slot, buf)
                return
            reg = geo.reg_layout()
            shape = (geo.chunk, geo.p)
            xs = x_buf.at[slot].reshape(geo.bm, 2, geo.p) if geo.split else x_buf.at[slot].reshape(geo.bm, geo.p)
            cs = c_buf.at[buf].reshape(geo.bm, geo.p)
            ss = s_buf.at[buf].reshape(geo.bm) if geo.scales_2d else s_buf.at[buf]

            def bcast(v):
                return plgpu.layout_cast(lax.broadcast_in_dim(v, shape, (0,)), reg)

            def one_chunk(i, carry):
                sl = pl.ds(i * geo.chunk, geo.chunk)
                w = (tuple(ms.load(xs.at[sl, h], reg) for h in (0, 1)) if geo.split else ms.load(xs.at[sl], reg))
                packed, byte = encode(w, bcast)
                cs.at[sl][...] = packed
                ss.at[sl][...] = byte
                return carry

            lax.fori_loop(0, geo.bm // geo.chunk, one_chunk, 0)

        ms.stream(n_tiles=geo.n_tiles, n_ctas=n_ctas, stages=stages, barrier=barrier,
                  load=load, compute=compute, store=store)

    return body


STEP_BYTES = 16 * 1024  # input bytes per TMA tile by default: with 2 stages and the outputs ~ 45 KB of SMEM
# per CTA, three CTAs per SM, 256 groups per register pass; the fastest setting measured on the H200 at
# 128K x 512 (BENCHMARKS.md)


def default_rows_per_step(r: int, n: int, block: int, split: bool, n_ctas: int, step_bytes: int = STEP_BYTES) -> int:
    """Rows per tile: about ``step_bytes`` of kernel input, fewer when that leaves CTAs idle, rounded so a
    tile holds a multiple of 128 groups (and at most 256 rows, the TMA box limit)."""
    g = n // block
    unit = 128 // math.gcd(128, g)  # rows per 128 groups
    rows = step_bytes // (n * (4 if split else 2))
    rows = min(rows, r // n_ctas)  # small inputs: one tile per CTA at least
    return min(max(unit, rows // unit * unit), 256 // unit * unit)


@functools.partial(jax.jit, static_argnames=("fmt", "rows_per_step", "step_bytes", "chunk", "stages",
                                             "ctas_per_sm", "layout_name", "no_auto_barriers", "encode",
                                             "interpret"))
def pack(x, fmt: str, *, rows_per_step: int | None = None, step_bytes: int = STEP_BYTES, chunk: int = 256,
         stages: int = 2, ctas_per_sm: int = 3, layout_name: str = "rows", no_auto_barriers: bool = True,
         encode: str = "compare", interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit.

    Tuning (all static): ``rows_per_step`` rows per TMA tile (rows x groups per row must be a multiple
    of 128; default: ``default_rows_per_step`` for ``step_bytes`` of input per tile), ``chunk`` groups
    per register pass at most (the largest divisor of the tile in multiples of 128 for
    ``layout_name="rows"``, of 64 for ``"wgmma"``), ``stages`` input slots per CTA, ``ctas_per_sm``
    resident CTAs per SM (sizes the persistent grid), ``no_auto_barriers`` drops the barriers Pallas puts
    around each SMEM store (the kernel never reads back what it stores; ``stream`` synchronises before
    every TMA). ``encode`` picks the code index: ``"compare"`` (7 compares a lane, the default),
    ``"bsearch"`` (a binary search: 3 compares and 3 selects, ``thresholds.code_index_bsearch``) or
    ``"swar"`` (bf16 input: both lanes of a word per subtraction, ``mosaic_encode.encode_words``); all bit-exact,
    and on the H200 the default was fastest or equal (the loop, not the encode, bounds the kernel:
    BENCHMARKS.md). ``interpret=True`` runs the GPU interpreter (CPU; no register layouts).
    """
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    if n % block:
        raise ValueError(f"fp4_pack: the last axis ({n}) must be a multiple of the group size ({block})")
    r = math.prod(lead)
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    xin, split = to_kernel_input(x, block)
    max_ctas = ctas_per_sm * ms.num_sms()
    if rows_per_step is None:
        rows_per_step = default_rows_per_step(r, n, block, split, max_ctas, step_bytes)
    geo = _Geometry(r, n, fmt, split, operator.index(rows_per_step), chunk, layout_name, encode)
    if interpret:
        geo.pad_outputs()
    n_ctas = min(geo.n_tiles, max_ctas)
    scratch = [
        plgpu.SMEM((stages, *geo.in_block), jnp.int32),
        plgpu.SMEM((2, *geo.codes_block), jnp.uint8),
        plgpu.SMEM((2, *geo.scales_block), jnp.uint8),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    ]
    out_type = (jax.ShapeDtypeStruct(geo.codes_view, jnp.uint8), jax.ShapeDtypeStruct(geo.scales_view, jnp.uint8))
    codes, scales = ms.kernel(_kernel_body(geo, interpret, n_ctas, stages), out_type=out_type,
                              scratch_types=scratch, n_ctas=n_ctas, interpret=interpret,
                              no_auto_barriers=no_auto_barriers)(xin)
    codes = codes.reshape(geo.rows_out, geo.g, geo.p)[:r]
    return layout.join(lead, codes, scales.reshape(geo.scale_rows, geo.g)[:r], fmt)


def write(codes_cache, scales_cache, x, index, fmt: str, *, interpret: bool = False, **tuning):
    """``fp4_pack.api.write_*``: the new rows packed by :func:`pack`, then scattered to their slots by XLA.

    Not fused: Mosaic GPU stores leave SMEM through TMA boxes of >= 16 bytes, and an MXFP4 scale row is 4
    bytes, so rows cannot go to their slots one by one from the kernel. The scatter moves only the packed
    bytes (a quarter of the input's for bf16); with the caches donated it updates them in place.
    """
    codes, scales = pack(x, fmt, interpret=interpret, **tuning)
    return reference.write_rows(codes_cache, codes, index), reference.write_rows(scales_cache, scales, index)


# ------------------------------------------------------------------------------------------------
# unpack: packed nibbles + scale bytes -> values (the inverse of pack, bit-identical to quant.unpack_*)


class _UnpackGeometry:
    """Static shapes of one unpack call. GMEM views (TMA boxes: innermost extent >= 16 bytes, <= 256
    elements per dimension): codes [R, N/2] bytes (or [R, N/512, 256]); scale bytes flat in rows of 16
    ([ceil(R G / 16), 16], padded by XLA, a tile's G·rows bytes being whole rows of it); output bf16 pairs
    as 32-bit words [R, N/2] (or [R, N/512, 256]), or for other dtypes fp32 [R, N] (or [R, N/256, 256])
    holding each group's [evens | odds], which XLA interleaves after (one extra pass, as pack's fp32 input).
    In SMEM every buffer is declared in its register view ([tile groups, P], P bytes or words per group),
    and TMA reaches it through a reshape to the box, so no ref reshape splits a minor dimension."""

    def __init__(self, r: int, n: int, fmt: str, split: bool, rows_per_step: int, chunk: int):
        block = layout.FORMATS[fmt]
        self.r, self.n, self.fmt, self.split = r, n, fmt, split
        self.g, self.p, half = n // block, block // 2, n // 2
        self.br = min(rows_per_step, 256)
        self.bm = self.br * self.g
        self.chunk = max((c for c in range(128, min(chunk, self.bm) + 1, 128) if self.bm % c == 0), default=chunk)
        wide = lambda v: (v,) if v <= 256 else (v // 256, 256)  # noqa: E731
        self.codes_view = (r, *wide(half))
        self.scale_rows = -(-r * self.g // 16)
        self.out_view = (r, *wide(n if split else half))
        problems = []
        if half % 16 or (half > 256 and half % 256):
            problems.append(f"N/2 ({half}) must be a multiple of 16 and at most 256 or a multiple of 256")
        if split and n > 256 and n % 256:
            problems.append(f"N ({n}) must be at most 256 or a multiple of 256 for a non-bf16 output")
        if self.bm % 128 or self.bm > 4096:
            problems.append(f"groups per tile ({self.bm} = rows_per_step x {self.g}) must be a multiple of 128 "
                            "and at most 4096")
        if self.chunk % 128 or self.bm % self.chunk:
            problems.append(f"chunk ({self.chunk}) must be a multiple of 128 dividing the groups per tile")
        if problems:
            raise ValueError(f"fp4_pack mosaic unpack ({fmt}, N={n}, rows_per_step={rows_per_step}, "
                             f"chunk={chunk}): " + "; ".join(problems))
        self.n_tiles = -(-r // self.br)
        self.rows_out = r

    def pad_outputs(self):
        self.rows_out = self.n_tiles * self.br
        self.out_view = (self.rows_out, *self.out_view[1:])

    def smem_bytes(self, stages: int) -> int:
        """SMEM of one CTA: ``stages`` slots of codes and scale bytes, two output buffers."""
        return stages * self.bm * (self.p + 1) + 2 * self.bm * 4 * self.p * (2 if self.split else 1)

    @property
    def smem(self):
        """Per-slot register views (compiled) and TMA boxes (interpreted / for the copies)."""
        out = (self.bm, 2, self.p) if self.split else (self.bm, self.p)
        return (self.bm, self.p), (self.bm,), out

    @property
    def boxes(self):
        return (self.br, *self.codes_view[1:]), (self.bm // 16, 16), (self.br, *self.out_view[1:])


def _unpack_body(geo: _UnpackGeometry, interpret: bool, n_ctas: int, stages: int):
    rows = functools.partial(pl.ds, size=geo.br)
    c_box, s_box, o_box = geo.boxes
    scale_fn = decode.SCALE_FNS[geo.fmt]

    def view(ref, box):
        return ref if interpret else ref.reshape(*box)

    def body(c_gmem, s_gmem, o_gmem, c_buf, s_buf, o_buf, barrier):
        def load(t, slot):
            plgpu.copy_gmem_to_smem(c_gmem.at[rows(t * geo.br)], view(c_buf.at[slot], c_box), barrier.at[slot])
            plgpu.copy_gmem_to_smem(s_gmem.at[pl.ds(t * (geo.bm // 16), geo.bm // 16)],
                                    view(s_buf.at[slot], s_box), barrier.at[slot])

        def store(t, buf):
            plgpu.copy_smem_to_gmem(view(o_buf.at[buf], o_box), o_gmem.at[rows(t * geo.br)])

        def words(even, odd):  # fp32 values exact in bf16: truncation is the rounding (NaN: canonical)
            bits = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
            return (bits(odd) & HI_HALF) | lax.shift_right_logical(bits(even), 16)

        def compute(t, slot, buf):
            del t
            if interpret:  # whole tile, value reshapes
                c = c_buf[slot].reshape(geo.bm, geo.p).astype(jnp.int32)
                sb = s_buf[slot].reshape(geo.bm).astype(jnp.int32)
                even, odd = decode.unpack_tile(c, sb, geo.fmt)
                out = jnp.stack([even, odd], axis=1) if geo.split else words(even, odd)
                o_buf[buf] = out.reshape(o_box)
                return
            reg = ms.rows_layout(geo.p)
            shape = (geo.chunk, geo.p)
            cs, ss, os_ = c_buf.at[slot], s_buf.at[slot], o_buf.at[buf]

            def one_chunk(i, carry):
                sl = pl.ds(i * geo.chunk, geo.chunk)
                c = ms.load(cs.at[sl], reg).astype(jnp.int32)
                scale = scale_fn(ms.load(ss.at[sl], reg.reduce(1)).astype(jnp.int32))
                scale = plgpu.layout_cast(lax.broadcast_in_dim(scale, shape, (0,)), reg)
                even, odd = decode.e2m1_value(c & 0xF) * scale, decode.e2m1_value(c >> 4) * scale
                if geo.split:
                    os_.at[sl, 0][...] = even
                    os_.at[sl, 1][...] = odd
                else:
                    os_.at[sl][...] = words(even, odd)
                return carry

            lax.fori_loop(0, geo.bm // geo.chunk, one_chunk, 0)

        ms.stream(n_tiles=geo.n_tiles, n_ctas=n_ctas, stages=stages, barrier=barrier,
                  load=load, compute=compute, store=store)

    return body


@functools.partial(jax.jit, static_argnames=("fmt", "dtype", "rows_per_step", "chunk", "stages", "ctas_per_sm",
                                             "no_auto_barriers", "interpret"))
def unpack(codes, scales, fmt: str, dtype=jnp.float32, *, rows_per_step: int | None = None, chunk: int = 128,
           stages: int = 2, ctas_per_sm: int = 3, no_auto_barriers: bool = True, interpret: bool = False):
    """Packed nibbles [..., N/2] and scales [..., G] -> the ``quant.unpack_<fmt>`` values, bit for bit.

    bf16 output is written as pairs of lanes in 32-bit words; other dtypes go through fp32 halves that XLA
    interleaves (and casts). Tuning as :func:`pack`; ``rows_per_step`` defaults to ~16 KB of output words.
    """
    block = layout.FORMATS[fmt]
    c, sb = layout.split_codes(codes, scales, block)
    r, g, p = c.shape
    n = g * block
    dtype = jnp.dtype(dtype)
    if r == 0:
        return jnp.zeros((*codes.shape[:-1], n), dtype)
    split = dtype != jnp.bfloat16
    if rows_per_step is None:
        unit = 128 // math.gcd(128, g)
        want = STEP_BYTES // (n * 2)
        want = min(want, max(unit, r // (ctas_per_sm * ms.num_sms())))
        rows_per_step = min(max(unit, want // unit * unit), 4096 // g // unit * unit)
    geo = _UnpackGeometry(r, n, fmt, split, operator.index(rows_per_step), chunk)
    if geo.smem_bytes(stages) > _SMEM_BYTES:
        raise ValueError(f"fp4_pack mosaic unpack ({fmt}, N={n}, {dtype.name}): rows_per_step={rows_per_step} "
                         f"with {stages} stages needs {geo.smem_bytes(stages)} bytes of SMEM, over {_SMEM_BYTES}")
    if interpret:
        geo.pad_outputs()
    n_ctas = min(geo.n_tiles, ctas_per_sm * ms.num_sms())
    flat = sb.reshape(r * g)
    flat = jnp.pad(flat, (0, geo.scale_rows * 16 - r * g)).reshape(geo.scale_rows, 16)
    c_view = c.reshape(geo.codes_view)
    c_smem, s_smem, o_smem = geo.boxes if interpret else geo.smem
    out_dtype = jnp.float32 if split else jnp.int32
    scratch = [
        plgpu.SMEM((stages, *c_smem), jnp.uint8),
        plgpu.SMEM((stages, *s_smem), jnp.uint8),
        plgpu.SMEM((2, *o_smem), out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    out = ms.kernel(_unpack_body(geo, interpret, n_ctas, stages),
                    out_type=jax.ShapeDtypeStruct(geo.out_view, out_dtype), scratch_types=scratch,
                    n_ctas=n_ctas, interpret=interpret, no_auto_barriers=no_auto_barriers)(c_view, flat)
    out = out.reshape(geo.rows_out, -1)[:r]
    if split:
        out = jnp.swapaxes(out.reshape(r, g, 2, p), -1, -2).astype(dtype)
    else:
        out = lax.bitcast_convert_type(out, jnp.bfloat16)  # [r, N/2, 2]: word i = lanes (2i, 2i + 1)
    return out.reshape(*codes.shape[:-1], n)
