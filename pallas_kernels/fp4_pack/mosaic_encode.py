"""The threshold encodes of the Mosaic GPU packers and the kernel input they take, shared by ``mosaic.pack``
(the TMA-loop pack) and ``direct.pack`` / ``direct.write`` (the api's GPU pack and cache write).

Input (:func:`to_kernel_input`): bf16 latents as 32-bit words, the pair of lanes (2i, 2i+1) in one word
(a free bitcast; low half = even lane), so element 2i lands in the low nibble of byte i without a lane
shuffle; other dtypes as fp32 bit patterns with each group transposed by XLA to [evens | odds] (one extra
read and write of the input: a pair of fp32 lanes is 64 bits, which no 32-bit register holds).

Encodes (``ENCODES``; all bit-identical to ``quant.pack_*``) work on register tiles of C groups, [C, P]
with P = block / 2, one group a row; ``bcast`` maps a per-group [C] array to [C, P] in the tile's register
layout. The per-group work (amax, the E4M3 / E8M0 scale, 7 thresholds: ``thresholds.group_scale``) runs
once per group, the per-element work is:

* ``"compare"`` (:func:`encode_lanes`): |x| of each lane against the 7 thresholds in fp32, 7 compares.
* ``"bsearch"`` (:func:`encode_lanes` with ``bsearch=True``): the code index by a binary search,
  ``thresholds.code_index_bsearch`` (3 compares and 3 selects).
* ``"swar"`` (:func:`encode_words`; bf16 input only): both lanes of a word per integer subtraction.

:func:`encode_tile` picks one by name. ``direct`` adds ``"pairs"``, the bf16x2 PTX encode of ``pairs``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp4_pack import thresholds

ENCODES = ("compare", "bsearch", "swar")
HI_HALF = -65536  # 0xFFFF0000 as int32: the high (odd) lane of a bf16 pair word, as fp32 bits
_ABS = 0x7FFFFFFF  # |x| mask of fp32 bits
_GUARDS = -0x7FFF8000  # 0x80008000 as int32: a guard bit above each 15-bit magnitude of a word


def to_kernel_input(x, block: int):
    """[..., N] -> (int32 view for the kernel, split?): bf16 pairs as words [R, G, P] (free), else fp32 bits
    [R, G, 2, P], each group's [evens | odds] (one XLA transpose); R = rows, G = N / block, P = block / 2."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    g, p = x.shape[-1] // block, block // 2
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x.reshape(rows, g, p, 2), jnp.int32), False
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).reshape(rows, g, p, 2)
    return jnp.swapaxes(bits, -1, -2), True  # [R, G, 2, P]: one XLA transpose


def encode_lanes(fmt: str, even_bits, odd_bits, bcast, bsearch: bool = False):
    """fp32 bit patterns of the even / odd lanes [C, P] -> (packed nibbles uint8 [C, P], scale byte uint8 [C]).

    ``bcast`` maps a per-group [C] array to [C, P] in the register layout of the inputs; ``bsearch`` takes
    the code index by binary search instead of 7 compares (the same codes).
    """
    f32 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.float32)
    ae, ao = f32(even_bits & _ABS), f32(odd_bits & _ABS)
    amax = jnp.max(jnp.maximum(ae, ao), axis=1)
    byte, thr = thresholds.group_scale(fmt, amax)
    thr = [bcast(t) for t in thr]
    sign = ((even_bits >> 28) & 0x08) | ((odd_bits >> 24) & 0x80)  # code bit 3 of each nibble
    code_index = thresholds.code_index_bsearch if bsearch else thresholds.code_index
    packed = code_index(ae, thr) | (code_index(ao, thr) << 4) | sign
    return packed.astype(jnp.uint8), byte.astype(jnp.uint8)


def encode_words(fmt: str, w, bcast):
    """``encode="swar"``: :func:`encode_lanes` for bf16 input, both lanes of a 32-bit word at once; words
    [C, P] -> (packed nibbles uint8 [C, P], scale byte uint8 [C]).

    For non-negative floats the order of the bit patterns is the order of the values, so ``|x| >= t`` for a
    bf16 ``x`` is ``mag >= ceil(bits(t) / 2^16)`` on its 15-bit magnitude. With a guard bit above each
    magnitude of the word, ``(mag_pair | guards) - (T | T << 16)`` cannot borrow across the halves (T <=
    2^15), and its bit 15 (31) is set exactly when the low (high) magnitude reaches T: one subtraction, a
    shift and a mask count one threshold for both lanes, against two compares and two adds.
    """
    mags = w & 0x7FFF7FFF
    lo, hi = mags & 0xFFFF, lax.shift_right_logical(mags, 16)
    amax = lax.bitcast_convert_type(jnp.max(jnp.maximum(lo, hi), axis=1) << 16, jnp.float32)
    byte, thr = thresholds.group_scale(fmt, amax)
    guarded = mags | _GUARDS
    count = None
    for t in thr:
        tb = lax.bitcast_convert_type(t, jnp.int32)  # >= 0: thresholds are positive (or NaN patterns)
        t16 = jnp.minimum((tb >> 16) + ((tb & 0xFFFF) != 0).astype(jnp.int32), 0x8000)
        hit = lax.shift_right_logical(guarded - bcast(t16 | (t16 << 16)), 15) & 0x00010001
        count = hit if count is None else count + hit
    sign = ((w >> 12) & 0x08) | (lax.shift_right_logical(w, 24) & 0x80)
    packed = (count & 7) | ((count >> 12) & 0x70) | sign
    return packed.astype(jnp.uint8), byte.astype(jnp.uint8)


def _lane_bits(w, split: bool):
    """Kernel input rows -> fp32 bit patterns of (even, odd) lanes: bf16 words split in registers, or the
    two halves of a pre-split fp32 group."""
    return w if split else (w << 16, w & HI_HALF)


def encode_tile(fmt: str, w, bcast, *, split: bool, encode: str = "compare"):
    """One register tile of kernel input -> (packed nibbles uint8 [C, P], scale bytes uint8 [C]) by the
    encode named ``encode`` (one of ``ENCODES``). ``w``: the words [C, P] of bf16 pairs, or when ``split``
    (see :func:`to_kernel_input`) the (evens, odds) fp32 bit patterns, each [C, P]."""
    if encode == "swar":
        return encode_words(fmt, w, bcast)
    return encode_lanes(fmt, *_lane_bits(w, split), bcast, bsearch=encode == "bsearch")
