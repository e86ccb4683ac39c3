"""32-bit device Engram hashing (spec model §6.3–6.5) against the host int64 EngramHasher and the golden rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsv41_jax.config import tiny, v41_flash
from dsv41_jax.engram_device import (
    device_engram,
    device_history_init,
    device_row_ids,
    horner_digit_shifts,
    host_limbs,
    mod_limbs,
    mul_limbs,
)
from dsv41_jax.engram_hash import DEAD, EngramHasher, check_token_map
from dsv41_jax.testing import GOLDEN

RAW_VOCAB = 129_280  # release tokenizer size (spec model §6.2)


def _limbs_to_int(limbs: np.ndarray) -> list[int]:
    limbs = np.asarray(limbs).reshape(-1, 4)
    return [sum(int(x) << (16 * j) for j, x in enumerate(row)) for row in limbs]


# ---------------------------------------------------------------------------------------------------
# limb arithmetic against Python integers


def _extreme_u64(rng, n):
    edge = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**32 - 1, 2**32, 2**48 - 1, 2**62, 2**63 - 1, 2**63,
            2**63 + 1, 2**64 - 2, 2**64 - 1, 0x8000_0000_0000_FFFF, 0x7FFF_0000_FFFF_0000]
    rand = [int(x) for x in rng.integers(0, 2**63, size=n, dtype=np.uint64)]
    rand += [int(x) + 2**63 for x in rng.integers(0, 2**63, size=n, dtype=np.uint64)]
    rand += [int(x) for x in rng.integers(0, 2**40, size=n, dtype=np.uint64)]  # short values
    return edge + rand


def test_host_limbs_round_trip():
    vals = [0, 1, 2**64 - 1, 2**63, 76632096046245]
    assert _limbs_to_int(host_limbs(vals)) == vals
    # negative ints give the int64 two's complement bit pattern
    assert _limbs_to_int(host_limbs(np.array([-1, -(2**63), -5], np.int64))) == [2**64 - 1, 2**63, 2**64 - 5]
    assert host_limbs(vals).dtype == np.uint32 and host_limbs(vals).max() <= 0xFFFF


def test_mul_limbs_matches_python():
    rng = np.random.default_rng(0)
    # tokens: 31-bit (two limbs, as device_row_ids uses them) incl. the release compressed-vocab top
    toks = [0, 1, 2, 99091, 99092, 0xFFFF, 0x10000, 0x1FFFF, 2**31 - 1]
    toks += [int(x) for x in rng.integers(0, 2**31, size=40)]
    mults = _extreme_u64(rng, 20) + [76632096046245, 82619226485591, 2 * ((2**63 - 1) // 99092 // 2) - 1]
    a = np.array(toks, np.int64)[:, None]
    b = host_limbs(mults)[None]  # [1, M, 4]
    a_limbs = host_limbs(a)[..., :2]  # [T, 1, 2]
    got = np.asarray(jax.jit(mul_limbs)(jnp.asarray(a_limbs), jnp.asarray(b)))
    assert got.shape == (len(toks), len(mults), 4) and got.max() <= 0xFFFF
    want = [(t * m) % 2**64 for t in toks for m in mults]
    assert _limbs_to_int(got) == want
    # full 64 x 64 bit operands keep the low 64 bits
    x = _extreme_u64(rng, 10)
    got = np.asarray(jax.jit(mul_limbs)(jnp.asarray(host_limbs(x))[:, None], jnp.asarray(host_limbs(x))[None]))
    assert _limbs_to_int(got) == [(u * v) % 2**64 for u in x for v in x]


@pytest.mark.parametrize("p, width", [
    (2, 16), (3, 16), (61, 16), (109, 16), (65521, 16), (65537, 8), (16000057, 8), (16000889, 8),
    (2**24 - 3, 8), (268435399, 4), (1073741789, 2), (2147483647, 1), (2147483629, 1),
])
def test_mod_limbs_matches_python(p, width):
    shifts = horner_digit_shifts(p)
    assert len(shifts) * width == 16  # the widest digit for which r * 2**w + digit < 2**32
    rng = np.random.default_rng(p % 1000)
    vals = _extreme_u64(rng, 30) + [p, p - 1, p + 1, 2 * p, p * p, (2**64 // p) * p, (2**64 // p) * p - 1]
    x = jnp.asarray(host_limbs(vals))
    pp = jnp.full((len(vals),), p, jnp.uint32)
    fn = jax.jit(mod_limbs)
    got = np.asarray(fn(x, pp, jnp.asarray(shifts)))
    assert got.tolist() == [v % p for v in vals]
    # as signed int64 the floor modulo equals numpy's np.mod (Python's % on the signed value)
    signed = [v - 2**64 if v >= 2**63 else v for v in vals]
    c = jnp.full((len(vals),), 2**64 % p, jnp.uint32)
    got = np.asarray(fn(x, pp, jnp.asarray(shifts), c))
    assert got.tolist() == [v % p for v in signed]
    np.testing.assert_array_equal(got, np.mod(np.array(signed, np.int64), np.int64(p)))


def test_mod_limbs_per_column_primes_broadcast():
    # one value per order, several primes per column, as device_row_ids lays them out
    vals = [2**63 - 1, 12345678901234567, 2**64 - 1]
    primes = np.array([16000057, 16000463, 61], np.uint32)
    x = jnp.asarray(host_limbs(vals))[:, None]  # [3, 1, 4]
    got = np.asarray(jax.jit(mod_limbs)(x, jnp.asarray(primes), jnp.asarray(horner_digit_shifts(int(primes.max())))))
    assert got.tolist() == [[v % int(p) for p in primes] for v in vals]


def test_horner_digit_shifts_bounds():
    assert horner_digit_shifts(2**16).tolist() == [0]
    assert horner_digit_shifts(2**16 + 1).tolist() == [8, 0]
    assert horner_digit_shifts(2**31).tolist() == list(range(15, -1, -1))
    with pytest.raises(ValueError, match="2\\*\\*31"):
        horner_digit_shifts(2**31 + 1)


def test_device_engram_rejects_tables_beyond_int32():
    # primes near 2**30: the concatenated columns exceed int32 row ids
    cfg = tiny().engram
    big = type(cfg)(**{**cfg.__dict__, "vocab_size": 2**30, "n_heads": 1})
    with pytest.raises(ValueError, match="int32 row ids"):
        device_engram(EngramHasher(big, np.arange(cfg.compressed_vocab_size)))
    with pytest.raises(ValueError, match="token map"):
        device_engram(EngramHasher(cfg, np.array([0, 1, 2, -1])))


# ---------------------------------------------------------------------------------------------------
# row ids against the host hasher


def _release_token_map(pad_top: bool) -> np.ndarray:
    """129,280 raw ids onto all 99,092 compressed ids (ids 0..2 -> 0..2, the rest shuffled).

    With pad_top the pad (raw id 2) maps to the largest compressed id, so every blocked look-back uses the
    largest products too.
    """
    cfg = v41_flash().engram
    rng = np.random.default_rng(7)
    v = cfg.compressed_vocab_size
    tm = np.concatenate([[0, 1, 2], 3 + rng.permutation(v - 3), rng.integers(0, v, RAW_VOCAB - v)]).astype(np.int64)
    if pad_top:
        top = int(np.flatnonzero(tm == v - 1)[0])
        tm[[2, top]] = tm[[top, 2]]
    check_token_map(tm, cfg)
    return tm


def _golden_token_map() -> np.ndarray:
    path = GOLDEN / "inputs.npz"
    if not path.exists():
        pytest.skip(f"golden data not found at {GOLDEN}")
    return np.load(path)["engram_token_map"]


CASES = {
    "tiny": lambda: (tiny().engram, _golden_token_map()),
    "release": lambda: (v41_flash().engram, _release_token_map(pad_top=False)),
    "release_pad_top": lambda: (v41_flash().engram, _release_token_map(pad_top=True)),
    # compressed ids far beyond the vocabulary: numpy's int64 products wrap negative, np.mod floors
    "tiny_wrapping": lambda: (tiny().engram, np.random.default_rng(3).integers(2**30, 2**31, 512)),
}


def _sequence(token_map, bsz, seq, rng):
    """Raw ids, half of them on the largest compressed ids, and DEAD spans (start, middle, single, long)."""
    top = np.flatnonzero(token_map >= np.sort(token_map)[-min(50, len(token_map))])
    tok = rng.integers(0, len(token_map), size=(bsz, seq))
    tok = np.where(rng.random((bsz, seq)) < 0.5, rng.choice(top, size=(bsz, seq)), tok)
    dead = np.zeros((bsz, seq), bool)
    dead[0, 0:3] = True
    dead[0, 20:29] = True
    dead[1, 1] = True
    dead[1, 19:22] = True
    dead[2, 9] = dead[2, 11] = True
    dead[2, seq - 1] = True
    return tok, dead


@jax.jit
def _decode_loop(tables, history, n_seen, toks, dead):
    """One token per step inside lax.while_loop, as the sampling loop calls it."""
    bsz, steps = toks.shape
    out = jnp.zeros((bsz, steps) + tables.offsets.shape, jnp.int32)

    def body(carry):
        i, hist, n, out = carry
        tok = lax.dynamic_slice_in_dim(toks, i, 1, axis=1)
        d = lax.dynamic_slice_in_dim(dead, i, 1, axis=1)
        rows, hist, n = device_row_ids(tables, hist, n, tok, d)
        return i + 1, hist, n, lax.dynamic_update_slice_in_dim(out, rows, i, axis=1)

    _, hist, n, out = lax.while_loop(lambda c: c[0] < steps, body, (jnp.int32(0), history, n_seen, out))
    return out, hist, n


_row_ids = jax.jit(device_row_ids)
# per-sequence calls: no batch axis inside
_row_ids_per_seq = jax.jit(jax.vmap(device_row_ids, in_axes=(None, 0, 0, 0, None)))


@pytest.mark.parametrize("case", list(CASES))
def test_device_rows_equal_host(case):
    cfg, token_map = CASES[case]()
    hasher = EngramHasher(cfg, token_map)
    tables = device_engram(hasher)
    # Horner digit width: 16 bits for the tiny primes (< 2**16), 8 for the release ones (< 2**24)
    assert tables.digit_shifts.shape == ((2,) if case.startswith("release") else (1,))
    rng = np.random.default_rng(1)
    bsz, seq = 3, 52
    tok, dead = _sequence(hasher.token_map, bsz, seq, rng)
    want, want_hist = hasher.row_ids(tok, dead)
    if case.startswith("release"):
        # the test reaches the top of the int64 range that spec §6.4's bound allows
        assert int(hasher.token_map[tok].max()) * int(hasher.mults.max()) > 2**62
    if case == "tiny_wrapping":
        assert (hasher.token_map[tok[:, :, None]] * hasher.mults[:, 0] < 0).any()

    # one shot
    hist0, n0 = device_history_init(tables, bsz)
    rows, hist, n = _row_ids(tables, hist0, n0, jnp.asarray(tok, jnp.int32), jnp.asarray(dead))
    assert rows.dtype == jnp.int32 and rows.shape == want.shape
    np.testing.assert_array_equal(np.asarray(rows), want)
    np.testing.assert_array_equal(np.asarray(hist), want_hist.ids)
    np.testing.assert_array_equal(np.asarray(n), want_hist.n_seen)
    # at the sequence start the p < k test alone blocks look-backs, whatever the history slots hold
    junk = jnp.asarray(hasher.token_map[tok[:, :3]], jnp.int32)
    rows, _, _ = _row_ids(tables, junk, n0, jnp.asarray(tok, jnp.int32), jnp.asarray(dead))
    np.testing.assert_array_equal(np.asarray(rows), want)

    # chunked with the history carried: a first chunk shorter than K-1, boundaries inside a DEAD span
    # (22, 24) and right after one (22); two chunk lengths only, to keep compilation short
    parts, hist, n = [], hist0, n0
    for lo, hi in [(0, 2), (2, 22), (22, 24), (24, seq - 8)]:
        r, hist, n = _row_ids(tables, hist, n, jnp.asarray(tok[:, lo:hi], jnp.int32), jnp.asarray(dead[:, lo:hi]))
        parts.append(np.asarray(r))

    # ... then decode the last 8 tokens one at a time under jit + while_loop
    dec, hist, n = _decode_loop(tables, hist, n, jnp.asarray(tok[:, seq - 8:], jnp.int32),
                                jnp.asarray(dead[:, seq - 8:]))
    np.testing.assert_array_equal(np.concatenate(parts + [np.asarray(dec)], 1), want)
    np.testing.assert_array_equal(np.asarray(hist), want_hist.ids)
    np.testing.assert_array_equal(np.asarray(n), want_hist.n_seen)

    # a state taken over from the host EngramHistory mid-sequence, per-sequence vmap, no dead mask
    _, mid = hasher.row_ids(tok[:, :32], dead[:, :32])
    want_tail, _ = hasher.row_ids(tok[:, 32:], None, mid)
    r, _, _ = _row_ids_per_seq(tables, jnp.asarray(mid.ids, jnp.int32), jnp.asarray(mid.n_seen, jnp.int32),
                               jnp.asarray(tok[:, 32:], jnp.int32), None)
    np.testing.assert_array_equal(np.asarray(r), want_tail)


# ---------------------------------------------------------------------------------------------------
# golden reference rows (tiny checkpoint)


@pytest.mark.parametrize("tag", ["batch1", "batch2"])
def test_golden_prefill_and_decode_rows(tag):
    token_map = _golden_token_map()
    inp = np.load(GOLDEN / "inputs.npz")
    ref = np.load(GOLDEN / "ref_fp32.npz")
    hasher = EngramHasher(tiny().engram, token_map)
    tables = device_engram(hasher)
    ids = inp[f"{tag}_ids"]
    bsz, seq = ids.shape
    hist, n = device_history_init(tables, bsz)
    rows, hist, n = _row_ids(tables, hist, n, jnp.asarray(ids, jnp.int32), None)
    np.testing.assert_array_equal(np.asarray(rows), ref[f"{tag}_engram_row_ids"])
    np.testing.assert_array_equal(np.asarray(n), [seq] * bsz)

    # decode tokens at positions S..S+7, one per while_loop step, history carried from the prefill
    dec_ids = ref[f"{tag}_decode_input_ids"]
    dec, _, n = _decode_loop(tables, hist, n, jnp.asarray(dec_ids, jnp.int32), jnp.zeros(dec_ids.shape, bool))
    np.testing.assert_array_equal(np.asarray(dec), ref[f"{tag}_decode_engram_row_ids"])
    np.testing.assert_array_equal(np.asarray(n), [seq + dec_ids.shape[1]] * bsz)

    # the same state handed over from the host EngramHistory (DEAD = -1 slots before the start)
    _, h = hasher.row_ids(ids, None)
    assert (h.ids != DEAD).all()
    dec2, _, _ = _decode_loop(tables, jnp.asarray(h.ids, jnp.int32), jnp.asarray(h.n_seen, jnp.int32),
                              jnp.asarray(dec_ids, jnp.int32), jnp.zeros(dec_ids.shape, bool))
    np.testing.assert_array_equal(np.asarray(dec2), ref[f"{tag}_decode_engram_row_ids"])
