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
* **Bytes by permutes.** With the sign bits selected in at bits 3 and 19, a word holds the low nibble
  in byte 0 and the high nibble in byte 2; ``prmt`` gathers the nibbles of two words into one register,
  a shift and a bit select join nibble pairs, and a last ``prmt`` assembles four code bytes: 4 words ->
  1 word of codes.
* **The NVFP4 scale without long division.** ``div.rn.f32`` (correctly rounded, as ``quant._div_rn``)
  forms amax / 6, and :func:`nvfp4_scale_from_quotient` rounds it onto E4M3 on the bits; the thresholds
  are ``mul.rn.bf16x2`` of the scale pair by each midpoint pair (exact). ``thresholds.nvfp4_scale``'s
  integer long division cost as much as the element loop's compares (BENCHMARKS.md).

Per 4 words (8 elements) ptxas emits 28 compares and 28 adds (``HSET2``, ``HADD2`` / ``HFMA2.MMA``) and
~18 integer ops; the whole kernel is ~15 instructions an element at 1024 groups a CTA, against ~35 with
the fp32 compares. The group maximum is ``max.bf16x2`` over the row's words.

:func:`encode` is the kernel body's form (inline PTX through ``plgpu.inline_mgpu``; sm_90 for the bf16x2
compare and add), :func:`encode_model` the same arithmetic in jnp on the same words, used by the GPU
interpreter on CPU: integer compares of the 15-bit magnitudes (for non-negative bf16 patterns the order
of the bits is the order of the values, and a NaN pattern compares false either way) and
``quant._div_rn`` for the quotient. Inputs are finite bf16 (a NaN input's codes are unspecified, as in
``thresholds``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import mosaic_stream as ms
from pallas_kernels.fp4_pack import thresholds

_ABS2 = 0x7FFF7FFF  # |x| of both lanes
_MU16 = [int(np.asarray(mu, np.float32).view(np.uint32)) >> 16 for mu in thresholds.MIDPOINTS]  # exact in bf16
_TINY16 = 0x0080  # 2^-126 in bf16
_BIAS2 = 0x43004300  # 128.0 in both halves
WORDS = ms.ROW_VECTOR  # words per vector register of the rows layout, and per code word


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


def group_patterns_model(fmt: str, amax):
    """Group amax (fp32, >= 0) -> (scale byte int32, the 7 threshold patterns in [0x80, 0x8000)): the
    per-group step of :func:`encode` in jnp (``quant._div_rn`` for the quotient that the PTX divides with
    ``div.rn.f32``)."""
    if fmt == "nvfp4":
        from dsv41_jax import quant

        q = quant._div_rn(jnp.maximum(amax, jnp.float32(6 * 2.0**-9)), jnp.float32(6.0))
        s, byte = nvfp4_scale_from_quotient(q)
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


def nvfp4_scale_from_quotient(q):
    """fp32 amax / 6, rounded to nearest (>= 2^-9) -> (E4M3 scale as fp32, its byte as int32): the
    reference's round-half-even onto E4M3 with saturation at 448, on the bits. From 2^-6 the 3 mantissa
    bits are rounded by an add (a carry into the exponent is the next binade's first value); below it the
    subnormal quantum 2^-9 is the ulp of 2^14, so ``q + 2^14`` rounds and its low bits are the byte."""
    qb = _f32_bits(q)
    normal = qb >= 0x3C800000  # 2^-6
    rn = (qb + 0x7FFFF + ((qb >> 20) & 1)) & -0x100000
    n = _f32_bits(q + jnp.float32(16384.0)) - 0x46800000  # quanta of 2^-9, rounded: the subnormal byte
    small = n.astype(jnp.float32) * jnp.float32(2.0**-9)  # not (q + 2^14) - 2^14, which XLA folds to q
    s = jnp.minimum(jnp.where(normal, lax.bitcast_convert_type(rn, jnp.float32), small), jnp.float32(448.0))
    return s, jnp.where(normal, (_f32_bits(s) >> 20) - 0x3C0, n)


def encode_model(fmt: str, words, bcast):
    """The interpreter's :func:`encode`: same inputs and outputs, jnp arithmetic."""
    byte, pats = group_patterns_model(fmt, row_amax_model(words))
    return codes_model(words, [bcast(pair(p)) for p in pats]), byte.astype(jnp.uint8)


# ------------------------------------------------------------------------------------------------
# PTX (compiled path)

_AMAX_PTX = f"""{{
.reg .b32 m, a;
and.b32 m, $1, {_ABS2:#x};
and.b32 a, $2, {_ABS2:#x}; max.bf16x2 m, m, a;
and.b32 a, $3, {_ABS2:#x}; max.bf16x2 m, m, a;
and.b32 a, $4, {_ABS2:#x}; max.bf16x2 m, m, a;
shl.b32 a, m, 16; and.b32 m, m, 0xFFFF0000; max.f32 $0, a, m;
}}"""  # the max |x| of 4 words as fp32 bits (each lane's bf16 widened: exact)
_DIV6_PTX = "{\n.reg .b32 a;\nmax.f32 a, $1, 0f3C400000;\ndiv.rn.f32 $0, a, 0f40C00000;\n}"  # max(amax, 6 2^-9) / 6
_SELECT = 0xE4  # lop3 table of (c ? a : b)


def _codes_ptx() -> str:
    """4 words ($1-$4) and 7 threshold pairs ($5-$11) -> 4 code bytes ($0)."""
    lines = ["{", ".reg .b32 a, c, k, q0, q1, r0, r1, r2, r3, s;", f"mov.b32 k, {_BIAS2:#x};"]
    for i in range(WORDS):
        lines.append(f"and.b32 a, ${i + 1}, {_ABS2:#x};")
        # r{i}: 128.0 + the count of thresholds reached, a bf16 in each half (the index in its low 3 bits)
        lines.append(f"set.ge.bf16x2.bf16x2 c, a, $5; add.rn.bf16x2 r{i}, c, k;")
        lines += [f"set.ge.bf16x2.bf16x2 c, a, ${t}; add.rn.bf16x2 r{i}, r{i}, c;" for t in range(6, 12)]
        lines.append(f"shr.b32 s, ${i + 1}, 12; lop3.b32 r{i}, r{i}, s, 0x00070007, {_SELECT:#x};")  # signs: bits 3, 19
    lines += [  # [lo0, hi0, lo1, hi1] nibbles a byte, the nibble pairs joined by a select, the 4 code bytes
        f"prmt.b32 q0, r0, r1, 0x6420; shr.b32 s, q0, 4; lop3.b32 q0, q0, s, 0x0F0F0F0F, {_SELECT:#x};",
        f"prmt.b32 q1, r2, r3, 0x6420; shr.b32 s, q1, 4; lop3.b32 q1, q1, s, 0x0F0F0F0F, {_SELECT:#x};",
        "prmt.b32 $0, q0, q1, 0x6420;",
        "}",
    ]
    return "\n".join(lines)


def _asm(operands, text):
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(i32, list(operands), text, "=r" + ",r" * len(operands), has_side_effects=False)


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


def _nvfp4_pattern_pairs(s_bits):
    """E4M3 scale (fp32 bits, an i32 value) -> the 7 threshold pairs: s in both halves, times each
    midpoint (``mul.rn.bf16x2``, exact), one up for the tie-down ones."""
    lines = []
    for mu_bits, up in zip(_MU16, thresholds.TIE_UP, strict=True):
        step = "" if up else "add.u32 $0, $0, 0x00010001;\n"
        lines.append("{\n.reg .b32 p, m;\nshr.b32 p, $1, 16;\nmul.lo.u32 p, p, 0x10001;\n"
                     f"mov.b32 m, {pair(mu_bits):#x};\nmul.rn.bf16x2 $0, p, m;\n{step}}}")
    return [_asm([s_bits], text) for text in lines]


def encode(fmt: str, words, layout):
    """[C, P] bf16-pair words in ``layout`` (``mosaic_stream.rows_layout(P)`` with C = 128: a thread owns a row)
    -> (codes uint8 [C, P], scale bytes uint8 [C]), bit-identical to ``quant.pack_<fmt>`` on the words'
    lanes. NVFP4: the row maximum's quotient by 6 in PTX (``div.rn.f32``), the scale from it in jnp
    (:func:`nvfp4_scale_from_quotient`), the thresholds from the scale in PTX; MXFP4: the thresholds in jnp
    from the row maximum."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c, p = words.shape
    if c != 128:
        raise ValueError(f"fp4_pack pairs: a thread owns one row, so the words come 128 rows at a time, got {c}")
    nvfp4 = fmt == "nvfp4"

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct((c, p), jnp.int32, layout=layout))
    def row_amax(ctx, w):  # each element the row's max |x| (nvfp4: max(amax, 6 2^-9) / 6), fp32 bits
        del ctx
        parts = [_asm(ws, _AMAX_PTX) for ws in ms.words_of(w)]
        m = parts[0]
        for q in parts[1:]:
            m = _asm([m, q], "max.f32 $0, $1, $2;")  # fp32 patterns of bf16 values: exact
        if nvfp4:
            m = _asm([m], _DIV6_PTX)
        return _splat_array([m] * len(parts), w, jnp.int32)

    n_extra = 1 if nvfp4 else 7  # the scale, or the 7 threshold pairs

    @plgpu.inline_mgpu(arg_types=(layout,) * (1 + n_extra),
                       return_type=plgpu.ShapeDtypeStruct((c, p), jnp.uint8, layout=layout))
    def code_bytes(ctx, w, *extra):
        del ctx
        per_row = [ms.words_of(t)[0][0] for t in extra]  # each a splat of the row's value
        pairs_ = _nvfp4_pattern_pairs(per_row[0]) if nvfp4 else per_row
        text = _codes_ptx()
        return _splat_array([_asm([*ws, *pairs_], text) for ws in ms.words_of(w)], w, jnp.uint8)

    def bcast(v):
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (c, p), (0,)), layout)

    m = lax.bitcast_convert_type(jnp.max(row_amax(words), axis=1), jnp.float32)
    if nvfp4:
        s, byte = nvfp4_scale_from_quotient(m)
        extra = [bcast(_f32_bits(s))]
    else:
        e = thresholds.mxfp4_scale(m)
        byte, extra = e + 127, [bcast(pair(q)) for q in mxfp4_patterns(e)]
    return code_bytes(words, *extra), byte.astype(jnp.uint8)
