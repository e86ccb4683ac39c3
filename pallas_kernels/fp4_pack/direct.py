"""fp4_pack on GPU without SMEM: Mosaic GPU loads each group straight from HBM into registers and stores
its packed bytes straight back, as an XLA elementwise fusion does.

``mosaic.pack`` moves a tile TMA -> SMEM -> registers -> SMEM -> TMA in a persistent loop of a few CTAs per
SM; on the H200 that loop bounds it at ~half the copy rate (BENCHMARKS.md). Here there is no loop and no
barrier: a grid of small CTAs (one warpgroup each, ``groups_per_cta`` groups, one group a thread per
128-group chunk) issues all its loads at once, encodes, and writes its codes (block / 2 bytes a group, contiguous
per thread) and scale bytes with plain vector stores. Latency is hidden by the many resident CTAs, not by
a software pipeline.

Encodes (all bit-identical to ``quant``): for bf16 input ``pairs.encode`` (both lanes of a word per
bf16x2 compare and add, inline PTX), which took the NVFP4 pack from 53% to 87% of the copy's rate on the
H200; for other dtypes ``mosaic_encode``'s ``"compare"`` (fp32 threshold compares on the pre-split lanes).

``write`` is the same kernel with each thread's stores sent to its group's cache slot (inline PTX
stores at computed addresses; Mosaic GPU has no per-thread scattered store), the caches being kernel
refs updated in place.

Views: input [M, P] int32 words (bf16 pairs; M = rows x groups, P = block / 2) or, for other input dtypes,
[M, 2, P] fp32 [evens | odds] (``mosaic_encode.to_kernel_input``'s transpose); codes [M, P] bytes, scales [M]
bytes. GMEM accesses carry no bounds checks, so the kernel covers the whole ``groups_per_cta`` tiles and
the few groups past the last one (fewer than ``groups_per_cta``) go through the XLA reference, written into
the kernel's outputs in place.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms
from pallas_kernels.fp4_pack import layout, pairs, reference
from pallas_kernels.fp4_pack.mosaic_encode import ENCODES, encode_tile, to_kernel_input

CHUNK = 128  # groups a register pass: one a thread
DIRECT_ENCODES = ("auto", *ENCODES, "pairs")  # auto: pairs for bf16 input, compare otherwise
_REFERENCE = {"nvfp4": reference.pack_nvfp4, "mxfp4": reference.pack_mxfp4}


def _encoder(fmt: str, p: int, split: bool, encode: str, interpret: bool):
    def enc(w, bcast):
        if encode == "pairs":
            return pairs.encode_model(fmt, w, bcast) if interpret else pairs.encode(fmt, w, ms.rows_layout(p))
        return encode_tile(fmt, w, bcast, split=split, encode=encode)

    return enc


def _chunks(x_gmem, p: int, split: bool, tg: int, enc, interpret: bool):
    """This CTA's ``tg`` groups, encoded: (first group of the chunk, chunk slice, codes, scale bytes, bcast)
    per 128-group chunk, every load of the CTA in flight before the first encode."""
    base = lax.axis_index(ms.CTA_AXIS) * tg
    starts = [base + i * CHUNK for i in range(tg // CHUNK)]
    if interpret:
        def bcast(v):
            return lax.broadcast_in_dim(v, (CHUNK, p), (0,))

        for start in starts:
            x = x_gmem[pl.ds(start, CHUNK)]
            yield (start, pl.ds(start, CHUNK), *enc((x[:, 0], x[:, 1]) if split else x, bcast), bcast)
        return
    reg = ms.rows_layout(p)

    def bcast(v):
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (CHUNK, p), (0,)), reg)

    def load(ref):
        return plgpu.load(ref, (), layout=reg, optimized=False)

    sls = [pl.ds(start, CHUNK) for start in starts]
    words = [(load(x_gmem.at[sl, 0]), load(x_gmem.at[sl, 1])) if split else load(x_gmem.at[sl]) for sl in sls]
    for start, sl, w in zip(starts, sls, words, strict=True):
        yield (start, sl, *enc(w, bcast), bcast)


def _body(fmt: str, p: int, split: bool, tg: int, encode: str, interpret: bool):
    enc = _encoder(fmt, p, split, encode, interpret)

    def body(x_gmem, codes_gmem, scales_gmem):
        for _, sl, packed, byte, _ in _chunks(x_gmem, p, split, tg, enc, interpret):
            if interpret:
                codes_gmem[sl] = packed
                scales_gmem[sl] = byte
            else:
                codes_gmem.at[sl][...] = packed
                scales_gmem.at[sl][...] = byte

    return body


def default_groups_per_cta(fmt: str, encode: str) -> int:
    """Groups a CTA packs: the fastest measured on the H200 at 128K rows (BENCHMARKS.md), 1024 for the
    pairs encode of NVFP4 (all 8 register passes' loads in flight), 256 otherwise."""
    return 1024 if (fmt, encode) == ("nvfp4", "pairs") else 256


def _prepare(x, fmt: str, encode: str, groups_per_cta: int | None):
    """Checked settings and the kernel's input: (encode, groups a CTA, input words [M, P] or [M, 2, P],
    pre-split?)."""
    if encode not in DIRECT_ENCODES:
        raise ValueError(f"fp4_pack direct: encode must be one of {DIRECT_ENCODES}, got {encode!r}")
    if encode == "auto":
        encode = "pairs" if x.dtype == jnp.bfloat16 else "compare"
    tg = default_groups_per_cta(fmt, encode) if groups_per_cta is None else groups_per_cta
    if tg % CHUNK or tg <= 0:
        raise ValueError(f"fp4_pack direct: groups_per_cta ({tg}) must be a positive multiple of {CHUNK}")
    block = layout.FORMATS[fmt]
    xin, split = to_kernel_input(x, block)
    if encode in ("swar", "pairs") and split:
        raise ValueError(f"fp4_pack direct: encode={encode!r} needs bf16 input (two lanes per 32-bit word), "
                         f"got {x.dtype}")
    m, p = x.size // block, block // 2
    return encode, tg, (xin.reshape(m, 2, p) if split else xin.reshape(m, p)), split


@functools.partial(jax.jit, static_argnames=("fmt", "groups_per_cta", "encode", "interpret"))
def pack(x, fmt: str, *, groups_per_cta: int | None = None, encode: str = "auto", interpret: bool = False):
    """[..., N] f32/bf16 -> the ``quant.pack_<fmt>`` outputs, bit for bit. ``groups_per_cta`` (a multiple
    of 128) sets the CTA's share: its loads are all in flight together. ``encode``: ``"pairs"`` (bf16
    input: both lanes of a word per bf16x2 instruction, ``pairs.py``), the default for bf16 through
    ``"auto"``, which takes ``"compare"`` for other dtypes; ``"compare"``, ``"bsearch"`` and ``"swar"`` as
    ``mosaic.pack``. ``groups_per_cta`` defaults to :func:`default_groups_per_cta`."""
    block, lead, n = layout.FORMATS[fmt], x.shape[:-1], x.shape[-1]
    if n % block:
        raise ValueError(f"fp4_pack: the last axis ({n}) must be a multiple of the group size ({block})")
    r, p = math.prod(lead), block // 2
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    m = r * (n // block)
    encode, groups_per_cta, xin, split = _prepare(x, fmt, encode, groups_per_cta)
    full = m // groups_per_cta
    codes = jnp.zeros((m, p), jnp.uint8)
    scales = jnp.zeros((m,), jnp.uint8)
    if full:
        kw = {"interpret": ms.interpret_params()} if interpret else {
            "compiler_params": plgpu.CompilerParams(unsafe_no_auto_barriers=True)}
        codes, scales = plgpu.kernel(
            _body(fmt, p, split, groups_per_cta, encode, interpret),
            out_type=(jax.ShapeDtypeStruct((m, p), jnp.uint8), jax.ShapeDtypeStruct((m,), jnp.uint8)),
            grid=(full,), grid_names=(ms.CTA_AXIS,), **kw)(xin)
    done = full * groups_per_cta
    if done < m:  # the last groups_per_cta - 1 groups at most: the reference, group by group
        tail_codes, tail_scales = _REFERENCE[fmt](x.reshape(m, block)[done:])
        codes = lax.dynamic_update_slice(codes, tail_codes, (done, 0))
        scales = lax.dynamic_update_slice(scales, layout.as_bytes(tail_scales).reshape(-1), (done,))
    return layout.join(lead, codes.reshape(r, n // block, p), scales.reshape(r, n // block), fmt)


FUSED_WRITE = jax.__version_info__ >= (0, 11)  # kernels that update operands in place (refs) need jax 0.11


def _scatter_ptx(p: int, g: int, s: int, t: int) -> str:
    """Group m ($4) of rows [B * S, G] -> stores of its code words ($5...) and scale byte (last) at group
    (b T + slot) G + g of the [B * T * G] caches ($2 codes, $3 scales), slot = slots[row] ($1); none when
    the slot is T (dropped). 64-bit addresses: a cache can hold more than 2^31 bytes."""
    nw = p // 4
    words = ", ".join(f"${5 + i}" for i in range(nw))
    vec = f"st.global.v{nw}.b32" if nw > 1 else "st.global.b32"
    return "\n".join([
        "{", ".reg .u32 row, g, b, slot;", ".reg .u64 a, d;", ".reg .pred ok;",
        f"div.u32 row, $4, {g}; rem.u32 g, $4, {g}; div.u32 b, row, {s};",
        "mul.wide.u32 a, row, 4; add.u64 a, a, $1; ld.global.u32 slot, [a];",
        f"setp.lt.u32 ok, slot, {t};",
        f"mul.wide.u32 d, b, {t}; cvt.u64.u32 a, slot; add.u64 d, d, a;",
        f"mul.lo.u64 d, d, {g}; cvt.u64.u32 a, g; add.u64 d, d, a;",
        f"mad.lo.u64 a, d, {p}, $2; @ok {vec} [a], {{{words}}};",
        f"add.u64 a, d, $3; @ok st.global.u8 [a], ${5 + nw};",
        "mov.u32 $0, 0;", "}"])


def _scatter(p: int, g: int, s: int, t: int):
    """``store(start, packed, byte, bcast, slots_ref, codes_ref, scales_ref)``: each thread's group (start +
    its thread index: in ``mosaic_stream.rows_layout`` thread i owns row i) stored at its cache slot, inline
    PTX (Mosaic GPU has no per-thread scattered store)."""
    reg = ms.rows_layout(p)

    @plgpu.inline_mgpu(arg_types=(reg, reg, reg, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def store(ctx, packed, byte, start, slots_ref, codes_ref, scales_ref):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, llvm

        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mu.c(CHUNK, i32))
        m = arith.addi(ms.words_of(start)[0][0], tid)
        words = [llvm.bitcast(i32, reg) for reg in packed.registers.flat]  # 4 code bytes a register
        ptrs = [llvm.ptrtoint(i64, mu.memref_ptr(r)) for r in (slots_ref, codes_ref, scales_ref)]
        operands = [*ptrs, m, *words, ms.words_of(byte)[0][0]]
        llvm.inline_asm(i32, operands, _scatter_ptx(p, g, s, t), "=r,l,l,l" + ",r" * (len(operands) - 3),
                        has_side_effects=True)

    def run(start, packed, byte, bcast, slots_ref, codes_ref, scales_ref):
        store(packed, bcast(byte.astype(jnp.int32)), bcast(jnp.full((CHUNK,), start, jnp.int32)), slots_ref,
              codes_ref, scales_ref)

    return run


def _write_body(fmt: str, p: int, split: bool, tg: int, encode: str, g: int, s: int, t: int):
    enc, store = _encoder(fmt, p, split, encode, False), _scatter(p, g, s, t)

    def body(x_gmem, slots_gmem, codes_ref, scales_ref):
        for start, _, packed, byte, bcast in _chunks(x_gmem, p, split, tg, enc, False):
            store(start, packed, byte, bcast, slots_gmem, codes_ref, scales_ref)

    return body


@functools.partial(jax.jit, static_argnames=("fmt", "groups_per_cta", "encode", "interpret"))
def write(codes_cache, scales_cache, x, index, fmt: str, *, groups_per_cta: int | None = None,
          encode: str = "auto", interpret: bool = False):
    """``fp4_pack.api.write_*`` on GPU: pack the new rows [B, S, N] and store row (b, s) at cache slot
    ``index[b, s]`` (out of range: dropped) in one kernel, the caches updated in place (donate them).

    Each thread stores its group's code words and scale byte at the slot's address (inline PTX), so the
    packed rows never make a round trip through HBM before an XLA scatter. The groups past the last whole
    CTA go through the reference and an XLA scatter. On jax < 0.11 (no in-place kernel operands) and in
    interpret mode: :func:`pack`, then XLA's scatter of the packed rows."""
    if interpret or not FUSED_WRITE:
        codes, scales = pack(x, fmt, groups_per_cta=groups_per_cta, encode=encode, interpret=interpret)
        return reference.write_rows(codes_cache, codes, index), reference.write_rows(scales_cache, scales, index)
    block = layout.FORMATS[fmt]
    (b, t, half), (_, s, n) = codes_cache.shape, x.shape
    g, p = n // block, block // 2
    if n % block or half * 2 != n or scales_cache.shape != (b, t, g) or index.shape != (b, s) or x.shape[0] != b:
        raise ValueError(f"fp4_pack direct write ({fmt}): caches {codes_cache.shape} / {scales_cache.shape}, rows "
                         f"{x.shape} and index {index.shape} do not fit [B, T, N/2] / [B, T, N/{block}], [B, S, N], "
                         "[B, S]")
    m = b * s * g
    if m == 0:
        return codes_cache, scales_cache
    encode, tg, xin, split = _prepare(x, fmt, encode, groups_per_cta)
    slots = layout.cache_slots(index, t).reshape(-1)
    codes = codes_cache.reshape(b * t * g, p)
    scales = layout.as_bytes(scales_cache).reshape(b * t * g)
    full = m // tg
    if full:
        kernel = plgpu.kernel(_write_body(fmt, p, split, tg, encode, g, s, t), out_type=(), grid=(full,),
                              grid_names=(ms.CTA_AXIS,),
                              compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
        codes, scales = pl.run_state(lambda refs: kernel(xin, slots, *refs))((codes, scales))
    done = full * tg
    if done < m:  # the last tg - 1 groups at most: the reference, then an XLA scatter to their slots
        tail_codes, tail_scales = _REFERENCE[fmt](x.reshape(m, block)[done:])
        grp = jnp.arange(done, m, dtype=jnp.int32)
        row, slot = grp // g, slots[grp // g]
        dest = jnp.where(slot < t, ((row // s) * t + slot) * g + grp % g, b * t * g)  # b t g: dropped
        codes = codes.at[dest].set(tail_codes, mode="drop")
        scales = scales.at[dest].set(layout.as_bytes(tail_scales).reshape(-1), mode="drop")
    return codes.reshape(codes_cache.shape), layout.from_bytes(scales.reshape(b, t, g), scales_cache.dtype)
