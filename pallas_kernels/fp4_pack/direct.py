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
H200; for other dtypes ``mosaic._encode`` (fp32 threshold compares on the pre-split lanes).

Views: input [M, P] int32 words (bf16 pairs; M = rows x groups, P = block / 2) or, for other input dtypes,
[M, 2, P] fp32 [evens | odds] (``mosaic._to_kernel_input``'s transpose); codes [M, P] bytes, scales [M]
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
from pallas_kernels.fp4_pack.mosaic import ENCODES, _encode, _encode_words, _lanes, _to_kernel_input, rows_layout

CHUNK = 128  # groups a register pass: one a thread
DIRECT_ENCODES = ("auto", *ENCODES, "pairs")  # auto: pairs for bf16 input, compare otherwise
_REFERENCE = {"nvfp4": reference.pack_nvfp4, "mxfp4": reference.pack_mxfp4}


def _body(fmt: str, p: int, split: bool, tg: int, encode: str, interpret: bool):
    def enc(w, bcast):
        if encode == "pairs":
            return pairs.encode_model(fmt, w, bcast) if interpret else pairs.encode(fmt, w, rows_layout(p))
        if encode == "swar":
            return _encode_words(fmt, w, bcast)
        return _encode(fmt, *_lanes(w, split), bcast, bsearch=encode == "bsearch")

    def body(x_gmem, codes_gmem, scales_gmem):
        base = lax.axis_index(ms.CTA_AXIS) * tg
        chunks = [pl.ds(base + i * CHUNK, CHUNK) for i in range(tg // CHUNK)]
        if interpret:
            for sl in chunks:
                x = x_gmem[sl]
                w = (x[:, 0], x[:, 1]) if split else x
                packed, byte = enc(w, lambda v: lax.broadcast_in_dim(v, (CHUNK, p), (0,)))
                codes_gmem[sl] = packed
                scales_gmem[sl] = byte
            return
        reg = rows_layout(p)

        def bcast(v):
            return plgpu.layout_cast(lax.broadcast_in_dim(v, (CHUNK, p), (0,)), reg)

        def load(ref):
            return plgpu.load(ref, (), layout=reg, optimized=False)

        words = [(load(x_gmem.at[sl, 0]), load(x_gmem.at[sl, 1])) if split else load(x_gmem.at[sl])
                 for sl in chunks]  # every load of the CTA in flight before the first encode
        for sl, w in zip(chunks, words, strict=True):
            packed, byte = enc(w, bcast)
            codes_gmem.at[sl][...] = packed
            scales_gmem.at[sl][...] = byte

    return body


def default_groups_per_cta(fmt: str, encode: str) -> int:
    """Groups a CTA packs: the fastest measured on the H200 at 128K rows (BENCHMARKS.md), 1024 for the
    pairs encode of NVFP4 (all 8 register passes' loads in flight), 256 otherwise."""
    return 1024 if (fmt, encode) == ("nvfp4", "pairs") else 256


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
    if encode not in DIRECT_ENCODES:
        raise ValueError(f"fp4_pack direct: encode must be one of {DIRECT_ENCODES}, got {encode!r}")
    if encode == "auto":
        encode = "pairs" if x.dtype == jnp.bfloat16 else "compare"
    if groups_per_cta is None:
        groups_per_cta = default_groups_per_cta(fmt, encode)
    if groups_per_cta % CHUNK or groups_per_cta <= 0:
        raise ValueError(f"fp4_pack direct: groups_per_cta ({groups_per_cta}) must be a positive multiple of {CHUNK}")
    r, p = math.prod(lead), block // 2
    if r == 0:
        return layout.empty(lead, n, block, fmt)
    m = r * (n // block)
    xin, split = _to_kernel_input(x, block)
    if encode in ("swar", "pairs") and split:
        raise ValueError(f"fp4_pack direct: encode={encode!r} needs bf16 input (two lanes per 32-bit word), "
                         f"got {x.dtype}")
    xin = xin.reshape(m, 2, p) if split else xin.reshape(m, p)
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


def write(codes_cache, scales_cache, x, index, fmt: str, *, interpret: bool = False, **tuning):
    """``fp4_pack.api.write_*`` on GPU: the new rows packed by :func:`pack`, then scattered to their slots by
    XLA (``mosaic.write`` says why the scatter is not in the kernel)."""
    codes, scales = pack(x, fmt, interpret=interpret, **tuning)
    return reference.write_rows(codes_cache, codes, index), reference.write_rows(scales_cache, scales, index)
