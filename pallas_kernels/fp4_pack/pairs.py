"""The bf16 encode on paired-lane (``bf16x2``) instructions: both lanes of a 32-bit word per compare.

For bf16 input a word holds lanes (2i, 2i+1), which land in the low and high nibble of code byte i. The
``thresholds`` encode unpacks each lane to fp32 and spends ~35 instructions an element (7 float compares,
their 0/1 materialisation, the adds, the unpacking); that issue rate, not memory, bounded the SMEM-less
pack on the H200 (BENCHMARKS.md). Here the compares stay in bf16:

* **Thresholds are exact in bf16.** ``mu s`` has at most 3 + 4 significant bits for an E4M3 scale ``s``
  and ``mu * 2^e`` at most 3 for an E8M0 scale, so each threshold is a bf16 value and ``|x| >= t`` for a
  bf16 ``x`` is the compare ``thresholds.code_index`` makes in fp32. The tie-down midpoints (``|x| > mu
  s``) become ``|x| >= next bf16 above mu s``: one added to the bit pattern. MXFP4 thresholds are built
  on the bit patterns (exponent add), floored at the smallest normal 2^-126 so that subnormal ``|x|``
  counts as zero (the reference runs on XLA:CPU, which flushes them); past the bf16 range a pattern is
  a NaN, which no finite ``|x|`` reaches, as in ``thresholds.mxfp4_thresholds``.
* **The count in bf16 arithmetic.** ``set.ge.bf16x2.bf16x2`` gives 1.0 or 0.0 in each half; the seven
  results are added onto 128.0 (``add.rn.bf16x2``, exact: bf16 steps by 1 on [128, 256)), so each half's
  bit pattern is 0x4300 + index, the code index in its low 3 bits and bits 3-7 clear.
* **Bytes by permutes.** With the sign bits ORed in at bits 3 and 19, a word holds the low nibble in byte
  0 and the high nibble in byte 2; ``prmt`` gathers the nibbles of two words into one register, a shift
  and an OR join nibble pairs, and a last ``prmt`` assembles four code bytes: 4 words -> 1 word of codes.

Per word: 1 AND, 7 compares and 7 adds on the paired-lane pipe, 2 ops for the sign, and 7 ops per 4 words
for the bytes, ~10 instructions an element; the group maximum is ``max.bf16x2`` over the row's words.

:func:`encode` is the kernel body's form (inline PTX through ``plgpu.inline_mgpu``; sm_90 for the bf16x2
compare and add), :func:`encode_model` the same arithmetic in jnp on the same words (integer compares
of the 15-bit magnitudes: for non-negative bf16 patterns the order of the bits is the order of the
values, and a NaN pattern compares false either way), used by the GPU interpreter on CPU. Inputs are
finite bf16 (a NaN input's codes are unspecified, as in ``thresholds``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp4_pack import thresholds

_ABS2 = 0x7FFF7FFF  # |x| of both lanes
_MU16 = [int(np.asarray(mu, np.float32).view(np.uint32)) >> 16 for mu in thresholds.MIDPOINTS]  # exact in bf16
_TINY16 = 0x0080  # 2^-126 in bf16
_BIAS2 = 0x43004300  # 128.0 in both halves
_SIGNS = 0x00080008  # the sign bits after the shift by 12: bit 3 (low lane) and bit 19 (high lane)
WORDS = 4  # words per vector register of the rows layout, and per code word


def _f32_bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def nvfp4_patterns(s):
    """E4M3 scale values (fp32, >= 2^-9) -> the 7 thresholds as bf16 bit patterns (int32), every compare
    ``|x| >= t``: ``mu s`` exactly, one pattern up for the tie-down midpoints."""
    return [(_f32_bits(s * jnp.float32(mu)) >> 16) + (0 if up else 1)
            for mu, up in zip(thresholds.MIDPOINTS, thresholds.TIE_UP, strict=True)]


def mxfp4_patterns(e):
    """E8M0 scale exponents (int32) -> the 7 thresholds as bf16 bit patterns, floored at 2^-126."""
    return [jnp.maximum(m + (e << 7) + (0 if up else 1), _TINY16)
            for m, up in zip(_MU16, thresholds.TIE_UP, strict=True)]


def patterns(fmt: str, amax):
    """Group amax (fp32, >= 0) -> (scale byte int32, the 7 threshold patterns in [0x80, 0x8000))."""
    if fmt == "nvfp4":
        s, byte = thresholds.nvfp4_scale(amax)
        return byte, nvfp4_patterns(s)
    e = thresholds.mxfp4_scale(amax)
    return e + 127, mxfp4_patterns(e)


def pair(p):
    """A bf16 bit pattern (int32 < 2^16) in both halves of a word."""
    return p * 0x10001


def row_amax_model(words):
    """[C, P] words -> [C] fp32: each row's max |x| over both lanes."""
    mags = words & _ABS2
    m = jnp.maximum(jnp.max(mags & 0xFFFF, axis=1), jnp.max(lax.shift_right_logical(mags, 16), axis=1))
    return lax.bitcast_convert_type(m << 16, jnp.float32)


def codes_model(words, pairs):
    """[C, P] words and 7 threshold pairs [C, P] -> [C, P] uint8 code bytes (the arithmetic of the PTX)."""
    mags = words & _ABS2
    lo, hi = mags & 0xFFFF, lax.shift_right_logical(mags, 16)
    idx_lo = sum((lo >= (t & 0xFFFF)).astype(jnp.int32) for t in pairs)
    idx_hi = sum((hi >= (t & 0xFFFF)).astype(jnp.int32) for t in pairs)
    sign = ((words >> 12) & 0x08) | (lax.shift_right_logical(words, 24) & 0x80)
    return (idx_lo | (idx_hi << 4) | sign).astype(jnp.uint8)


def encode_model(fmt: str, words, bcast):
    """The interpreter's :func:`encode`: same inputs and outputs, jnp arithmetic."""
    byte, pats = patterns(fmt, row_amax_model(words))
    return codes_model(words, [bcast(pair(p)) for p in pats]), byte.astype(jnp.uint8)


# ------------------------------------------------------------------------------------------------
# PTX (compiled path)

_AMAX_PTX = """{
.reg .b32 m, a;
and.b32 m, $1, 0x7FFF7FFF;
and.b32 a, $2, 0x7FFF7FFF; max.bf16x2 m, m, a;
and.b32 a, $3, 0x7FFF7FFF; max.bf16x2 m, m, a;
and.b32 a, $4, 0x7FFF7FFF; max.bf16x2 m, m, a;
shl.b32 a, m, 16; and.b32 m, m, 0xFFFF0000; max.f32 $0, a, m;
}"""  # the max |x| of 4 words as fp32 bits (each lane's bf16 widened: exact)


def _codes_ptx() -> str:
    """4 words ($1-$4) and 7 threshold pairs ($5-$11) -> 4 code bytes ($0)."""
    lines = ["{", ".reg .b32 a, c, k, q0, q1, r0, r1, r2, r3, s;", f"mov.b32 k, {_BIAS2:#x};"]
    for i in range(WORDS):
        lines.append(f"and.b32 a, ${i + 1}, {_ABS2:#x};")
        lines.append(f"set.ge.bf16x2.bf16x2 c, a, $5; add.rn.bf16x2 r{i}, c, k;")
        for t in range(6, 12):
            lines.append(f"set.ge.bf16x2.bf16x2 c, a, ${t}; add.rn.bf16x2 r{i}, r{i}, c;")
        lines.append(f"shr.b32 s, ${i + 1}, 12; and.b32 s, s, {_SIGNS:#x}; or.b32 r{i}, r{i}, s;")
    lines += [  # [lo0, hi0, lo1, hi1] nibbles a byte, then nibble pairs joined, then the 4 code bytes
        "prmt.b32 q0, r0, r1, 0x6420; shr.b32 s, q0, 4; or.b32 q0, q0, s;",
        "prmt.b32 q1, r2, r3, 0x6420; shr.b32 s, q1, 4; or.b32 q1, q1, s;",
        "prmt.b32 $0, q0, q1, 0x6420;",
        "}",
    ]
    return "\n".join(lines)


def _asm(ir_type, operands, text):
    from jaxlib.mlir.dialects import llvm

    return llvm.inline_asm(ir_type, list(operands), text, "=r" + ",r" * len(operands), has_side_effects=False)


def _words_of(arr):
    """A FragmentedArray's registers (vector<4 x i32> each) -> lists of 4 i32 values, in register order."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    out = []
    for reg in arr.registers.flat:
        if ir.VectorType(reg.type).shape != [WORDS]:
            raise NotImplementedError(f"fp4_pack pairs: expected vectors of {WORDS} words, got {reg.type}")
        out.append([llvm.extractelement(reg, mu.c(j, i32)) for j in range(WORDS)])
    return out


def _splat_array(values, like, dtype):
    """One i32 per register of ``like`` -> a FragmentedArray of ``like``'s layout whose vectors are
    ``values`` broadcast (int32) or bitcast to 4 bytes (uint8)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm
    from jaxlib.mlir.dialects import vector as vector_d

    regs = np.empty(like.registers.shape, dtype=object)
    if dtype == jnp.uint8:
        vt = ir.VectorType.get([WORDS], ir.IntegerType.get_signless(8))
        regs.flat[:] = [llvm.bitcast(vt, v) for v in values]
    else:
        vt = ir.VectorType.get([WORDS], ir.IntegerType.get_signless(32))
        regs.flat[:] = [vector_d.broadcast(vt, v) for v in values]
    return fa.FragmentedArray(_registers=regs, _layout=like.layout, _is_signed=dtype != jnp.uint8)


def encode(fmt: str, words, layout):
    """[C, P] bf16-pair words in ``layout`` (``mosaic.rows_layout(P)``: a thread owns a row) -> (codes
    uint8 [C, P], scale bytes uint8 [C]), bit-identical to ``quant.pack_<fmt>`` on the words' lanes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c, p = words.shape
    i32 = plgpu.ShapeDtypeStruct((c, p), jnp.int32, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=i32)
    def row_amax(ctx, w):  # each element the row's max |x| (fp32 bits); a thread's registers are its row
        del ctx
        from jaxlib.mlir import ir

        i32_t = ir.IntegerType.get_signless(32)
        parts = [_asm(i32_t, ws, _AMAX_PTX) for ws in _words_of(w)]
        m = parts[0]
        for q in parts[1:]:
            m = _asm(i32_t, [m, q], "max.f32 $0, $1, $2;")  # bf16 patterns in the high half: exact
        return _splat_array([m] * len(parts), w, jnp.int32)

    @plgpu.inline_mgpu(arg_types=(layout,) * 8, return_type=plgpu.ShapeDtypeStruct((c, p), jnp.uint8, layout=layout))
    def codes(ctx, w, *pairs):
        del ctx
        from jaxlib.mlir import ir

        i32_t = ir.IntegerType.get_signless(32)
        text = _codes_ptx()
        thr = [_words_of(t) for t in pairs]
        out = [_asm(i32_t, [*ws, *(t[r][0] for t in thr)], text) for r, ws in enumerate(_words_of(w))]
        return _splat_array(out, w, jnp.uint8)

    amax = lax.bitcast_convert_type(jnp.max(row_amax(words), axis=1), jnp.float32)
    byte, pats = patterns(fmt, amax)

    def bcast(v):
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (c, p), (0,)), layout)

    return codes(words, *(bcast(pair(q)) for q in pats)), byte.astype(jnp.uint8)
