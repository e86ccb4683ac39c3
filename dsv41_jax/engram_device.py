"""Engram row ids on device with 32-bit integers only: the jit/while_loop twin of ``EngramHasher.row_ids``.

The sampling loop must hash each new token without a host round trip, but JAX runs without x64, while the
hash of spec model §6.5 is int64 (``prod_k = tok_k * m_k``, XOR, ``mod prime``). Every 64-bit value is
therefore held as 4 little-endian 16-bit limbs in uint32 lanes:

* product  - schoolbook: each partial product of two 16-bit limbs is < 2**32, and each column sums only a
  few 16-bit halves plus a small carry, so nothing ever wraps (``mul_limbs``). The result is the product
  mod 2**64, i.e. exactly numpy's int64 bit pattern, even where numpy itself would wrap;
* XOR      - limb-wise;
* mod p    - Horner over w-bit digits, ``r = (r * 2**w + digit) % p`` with r < p <= 2**(32 - w), so every
  step stays below 2**32 (``mod_limbs``). w is the widest of 16, 8, 4, 2, 1 that the largest prime allows
  (16 for the tiny config, 8 for the release primes < 2**24, 1 for primes up to 2**31). numpy takes the
  floor modulo of the *signed* int64; when bit 63 is set the value is U - 2**64, so ``2**64 mod p`` is
  subtracted once more. Spec §6.4's bound keeps real products below 2**63, so that branch only matters
  for token maps outside the compressed vocabulary, where it keeps the two paths identical anyway.

State per sequence (spec model §6.5, as ``engram_hash.EngramHistory``): the last max_ngram_size - 1
compressed ids, oldest first, DEAD = -1 for image positions, and ``n_seen`` = absolute position of the
next token; the ``p < k`` test blocks look-backs before the sequence start.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int, UInt32

from dsv41_jax.engram_hash import DEAD, EngramHasher

N_LIMBS = 4  # 64-bit values as 4 limbs
LIMB_BITS = 16  # a limb product (2**16 - 1)**2 still fits uint32
_LIMB_MASK = (1 << LIMB_BITS) - 1
_DIGIT_BITS = (16, 8, 4, 2, 1)  # Horner digit widths that tile a 16-bit limb, widest first


class DeviceEngram(NamedTuple):
    """Constant tables of one Engram config on device (a pytree of small int32/uint32 arrays)."""

    token_map: Int[Array, " V"]  # int32: raw id -> compressed id (spec model §6.2)
    pad: Int[Array, ""]  # int32: compressed pad id, used for blocked look-backs (spec model §6.2 step 5)
    mult_limbs: UInt32[Array, "L J 4"]  # per-shift multipliers as 16-bit limbs (spec model §6.4)
    primes: UInt32[Array, "L G"]  # bucket modulus per column c = (n - 2) * n_heads + head (spec model §6.3)
    offsets: Int[Array, "L G"]  # int32: first row of each column's bucket range (spec model §6.3)
    two64_mod_p: UInt32[Array, "L G"]  # 2**64 mod prime: numpy's floor modulo of a negative int64
    # bit shift of each Horner digit inside a 16-bit limb, most significant first; its (static) length
    # fixes the digit width w = 16 / length, chosen so that every prime p satisfies p * 2**w <= 2**32
    digit_shifts: UInt32[Array, " digits"]


# ----------------------------------------------------------------------------------------------------
# host-side construction


def host_limbs(values) -> np.ndarray:
    """Integers (Python ints of any size or an int array) -> uint32 [..., 4]: 16-bit limbs of value mod 2**64.

    Negative values give their two's complement, i.e. the bit pattern numpy's int64 holds.
    """
    v = np.array(values, dtype=object)  # Python ints: shifts and masks act on the unbounded two's complement
    return np.stack([((v >> (LIMB_BITS * j)) & _LIMB_MASK).astype(np.uint32) for j in range(N_LIMBS)], axis=-1)


def horner_digit_shifts(max_prime: int) -> np.ndarray:
    """uint32 [16 // w]: digit shifts within a limb for the widest w with max_prime * 2**w <= 2**32.

    Raises ValueError for a modulus above 2**31 (even w = 1 would overflow, and rows are int32).
    """
    for w in _DIGIT_BITS:
        if max_prime << w <= 1 << 32:
            return np.arange(LIMB_BITS - w, -1, -w, dtype=np.uint32)
    raise ValueError(f"Engram prime {max_prime} exceeds 2**31: the 32-bit device hash cannot reduce modulo it")


def device_engram(hasher: EngramHasher) -> DeviceEngram:
    """Move a host EngramHasher's tables to device in the 32-bit form that ``device_row_ids`` uses."""
    token_map = np.asarray(hasher.token_map, np.int64)
    if token_map.size and (token_map.min() < 0 or token_map.max() >= 2**31):
        # compressed ids are >= 0 by construction (spec model §6.2 step 3); -1 would read as DEAD
        raise ValueError(f"Engram token map values must lie in [0, 2**31) for the int32 device map, got "
                         f"[{token_map.min()}, {token_map.max()}]")
    pad = int(hasher.pad)
    if not 0 <= pad < 2**31:
        raise ValueError(f"Engram pad id {pad} must lie in [0, 2**31)")
    primes = np.asarray(hasher.primes, np.int64)
    offsets = np.asarray(hasher.offsets, np.int64)
    if primes.min() < 2 or (offsets + primes).max() > 2**31:
        # the largest row of a column is offset + prime - 1; it must fit the int32 row ids
        raise ValueError(f"Engram tables of {int((offsets + primes).max())} rows do not fit int32 row ids "
                         f"(need offset + prime <= 2**31 for every column, primes >= 2)")
    mults = np.asarray(hasher.mults, np.int64)
    n_orders = mults.shape[1] - 1
    if n_orders < 1 or primes.shape[1] % n_orders:
        raise ValueError(f"{primes.shape[1]} Engram columns do not split into {n_orders} n-gram orders")
    two64 = np.array([[(1 << 64) % int(p) for p in row] for row in primes.tolist()], np.uint32)
    return DeviceEngram(
        token_map=jnp.asarray(token_map.astype(np.int32)),
        pad=jnp.asarray(np.int32(pad)),
        mult_limbs=jnp.asarray(host_limbs(mults)),
        primes=jnp.asarray(primes.astype(np.uint32)),
        offsets=jnp.asarray(offsets.astype(np.int32)),
        two64_mod_p=jnp.asarray(two64),
        digit_shifts=jnp.asarray(horner_digit_shifts(int(primes.max()))),
    )


def device_history_init(tables: DeviceEngram, batch: int) -> tuple[Int[Array, "B Jm1"], Int[Array, " B"]]:
    """Empty per-sequence state: (history int32 [B, J-1] all DEAD, n_seen int32 [B] zeros), as history_init."""
    k1 = tables.mult_limbs.shape[-2] - 1
    return jnp.full((batch, k1), DEAD, jnp.int32), jnp.zeros((batch,), jnp.int32)


# ----------------------------------------------------------------------------------------------------
# exact 64-bit arithmetic in uint32 lanes


def mul_limbs(a: UInt32[Array, "*A a_limbs"], b: UInt32[Array, "*B b_limbs"]) -> UInt32[Array, "*C 4"]:
    """Low 64 bits of a * b, all as little-endian 16-bit limbs in uint32 (broadcasting over leading axes).

    Column n sums the low halves of the partial products a_i * b_j with i + j = n, the high halves of those
    with i + j = n - 1 and the carry: at most 4 + 3 terms below 2**16 plus a carry below 8, far from 2**32.
    """
    a, b = a.astype(jnp.uint32), b.astype(jnp.uint32)
    cols: list[list] = [[] for _ in range(N_LIMBS)]
    for i in range(min(a.shape[-1], N_LIMBS)):
        for j in range(min(b.shape[-1], N_LIMBS - i)):  # limbs at 2**64 and above vanish mod 2**64
            pp = a[..., i] * b[..., j]  # < 2**32: exact
            cols[i + j].append(pp & _LIMB_MASK)
            if i + j + 1 < N_LIMBS:
                cols[i + j + 1].append(pp >> LIMB_BITS)
    out, carry = [], None
    for terms in cols:
        s = sum(terms[1:], terms[0]) if carry is None else sum(terms, carry)
        out.append(s & _LIMB_MASK)
        carry = s >> LIMB_BITS
    return jnp.stack(out, axis=-1)


def mod_limbs(x: UInt32[Array, "*B 4"], p: UInt32[Array, "..."], digit_shifts: UInt32[Array, " digits"],
              two64_mod_p: UInt32[Array, "..."] | None = None) -> UInt32[Array, "..."]:
    """x mod p for a 64-bit x in 16-bit limbs and p <= 2**(32 - w), w = 16 / len(digit_shifts).

    Without ``two64_mod_p`` x is unsigned; with it (= 2**64 mod p) x is a two's complement int64 and the
    result is the floor modulo in [0, p), as numpy's ``np.mod``. Shapes broadcast (x's limb axis aside).
    """
    n_digits = digit_shifts.shape[-1]
    w = LIMB_BITS // n_digits
    mask = (1 << w) - 1
    shape = jnp.broadcast_shapes(x.shape[:-1], p.shape)
    p = jnp.broadcast_to(p.astype(jnp.uint32), shape)  # lax.rem takes equal shapes
    r = jnp.zeros(shape, jnp.uint32)
    for j in reversed(range(N_LIMBS)):
        limb = x[..., j]
        for i in range(n_digits):
            digit = (limb >> digit_shifts[i]) & mask
            r = lax.rem((r << w) | digit, p)  # r < p <= 2**(32-w): r * 2**w + digit < 2**32
    if two64_mod_p is not None:
        # signed value = U - 2**64 when bit 63 is set; r + p - c < 2p <= 2**32 as p <= 2**31
        neg = (x[..., N_LIMBS - 1] >> (LIMB_BITS - 1)) == 1
        r = jnp.where(neg, lax.rem(r + (p - two64_mod_p.astype(jnp.uint32)), p), r)
    return r


# ----------------------------------------------------------------------------------------------------
# per-position row ids (spec model §6.5)


def device_row_ids(
    tables: DeviceEngram,
    history: Int[Array, "*B Jm1"],
    n_seen: Int[Array, "*B"],
    tokens: Int[Array, "*B S"],
    dead: Bool[Array, "*B S"] | None = None,
) -> tuple[Int[Array, "*B S L G"], Int[Array, "*B Jm1"], Int[Array, "*B"]]:
    """Row ids of ``tokens`` (raw ids) and the carried state, equal to ``EngramHasher.row_ids``.

    ``history`` holds the last J-1 compressed ids before tokens[..., 0] (oldest first, DEAD = -1) and
    ``n_seen`` the absolute position of tokens[..., 0]. Returns (rows int32 [..., S, L, G], new history,
    n_seen + S). Leading batch axes are free (also none, e.g. under vmap over sequences); S >= 1 is a
    chunk or one decode token. Raw ids outside the token map are clamped by the gather.
    """
    k_max = tables.mult_limbs.shape[-2]
    n_heads = tables.primes.shape[-1] // (k_max - 1)
    s = tokens.shape[-1]
    comp = tables.token_map[tokens]
    if dead is not None:
        comp = jnp.where(dead, jnp.int32(DEAD), comp)
    n_seen = n_seen.astype(jnp.int32)
    ext = jnp.concatenate([history.astype(jnp.int32), comp], axis=-1)  # position p at index J-1 + p - n_seen
    pos = n_seen[..., None] + jnp.arange(s, dtype=jnp.int32)

    blocked = jnp.zeros(comp.shape, bool)
    toks = []
    for k in range(k_max):
        val = ext[..., k_max - 1 - k: k_max - 1 - k + s]  # compressed id at p - k
        # once a look-back hits the start or a DEAD token, it and all larger shifts use pad (§6.5)
        blocked = blocked | (pos < k) | (val == DEAD)
        toks.append(jnp.where(blocked, tables.pad, val))
    t = jnp.stack(toks, axis=-1).astype(jnp.uint32)  # [..., S, J], each >= 0 and < 2**31: two limbs
    t_limbs = jnp.stack([t & _LIMB_MASK, t >> LIMB_BITS], axis=-1)[..., None, :]  # [..., S, J, 1, 2]
    prod = mul_limbs(t_limbs, jnp.swapaxes(tables.mult_limbs, 0, 1))  # tok_k * m[l, k]: [..., S, J, L, 4]
    hashes, h = [], prod[..., 0, :, :]
    for k in range(1, k_max):
        h = h ^ prod[..., k, :, :]
        hashes.append(h)  # the (k+1)-gram hash
    hs = jnp.stack(hashes, axis=-2)  # [..., S, L, n_orders, 4]
    hs = jnp.repeat(hs, n_heads, axis=-2)  # column c = (n-2)*n_heads + head shares order n's hash
    r = mod_limbs(hs, tables.primes, tables.digit_shifts, tables.two64_mod_p)
    rows = r.astype(jnp.int32) + tables.offsets  # < 2**31 by device_engram's check
    return rows, ext[..., ext.shape[-1] - (k_max - 1):], n_seen + s


def advance_history(tables: DeviceEngram, history: Array, n_seen: Array, tokens: Array, n_new: Array,
                    dead: Array | None = None):
    """The Engram history after the first ``n_new[b]`` tokens of a ragged chunk (padding is never history);
    ``dead`` (image-span) positions enter it as DEAD."""
    comp = tables.token_map[tokens]
    if dead is not None:
        comp = jnp.where(dead, jnp.int32(DEAD), comp)
    ext = jnp.concatenate([history, comp], axis=1)  # [B, J-1+S]
    idx = n_new[:, None] + jnp.arange(history.shape[1])[None]
    return jnp.take_along_axis(ext, idx, axis=1), n_seen + n_new
