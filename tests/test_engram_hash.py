"""Engram hashing (spec model §6.2–6.5) against the spec's release values and the golden reference outputs."""


import numpy as np
import pytest

from dsv41_jax.config import tiny, v41_flash
from dsv41_jax.engram_hash import (
    DEAD,
    EngramHasher,
    build_token_map,
    check_token_map,
    engram_multipliers,
    engram_offsets,
    engram_primes,
    history_init,
    row_ids,
)
from dsv41_jax.testing import GOLDEN  # noqa: E402

needs_golden = pytest.mark.skipif(not (GOLDEN / "inputs.npz").exists(),
                                  reason=f"golden data not found at {GOLDEN}")

# spec model §6.3
REL_PRIMES = [
    [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
     16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
     16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
    [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
     16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
     16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889],
]
REL_OFFSETS = [
    [0, 16000057, 32000136, 48000217, 64000314, 80000435, 96000564, 112000697, 128000880, 144001069,
     160001276, 176001487, 192001740, 208002017, 224002306, 240002613, 256002934, 272003273, 288003654,
     304004047, 320004446, 336004849, 352005258, 368005705],
    [0, 16000477, 32000964, 48001463, 64001970, 80002481, 96003054, 112003663, 128004290, 144004957,
     160005626, 176006319, 192007016, 208007727, 224008456, 240009215, 256009984, 272010765, 288011564,
     304012377, 320013196, 336014037, 352014914, 368015793],
]
# spec model §6.4
REL_MULTS = [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
             [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


# ---------------------------------------------------------------------------------------------------
# layout constants


def test_release_primes_and_offsets():
    cfg = v41_flash().engram
    p = engram_primes(cfg)
    assert p.dtype == np.int64 and p.shape == (2, 3, 8)
    np.testing.assert_array_equal(p.reshape(2, 24), np.array(REL_PRIMES, np.int64))
    np.testing.assert_array_equal(engram_offsets(cfg), np.array(REL_OFFSETS, np.int64))
    np.testing.assert_array_equal(p.reshape(2, -1).sum(1), [384006168, 384016682])
    assert tuple(p.reshape(2, -1).sum(1)) == cfg.num_embeddings


def test_tiny_primes():
    cfg = tiny().engram
    p = engram_primes(cfg)
    np.testing.assert_array_equal(p, [[[61, 67], [71, 73], [79, 83]], [[89, 97], [101, 103], [107, 109]]])
    np.testing.assert_array_equal(p.reshape(2, -1).sum(1), [434, 606])
    np.testing.assert_array_equal(engram_offsets(cfg), [[0, 61, 128, 199, 272, 351], [0, 89, 186, 287, 390, 497]])


def test_release_multipliers():
    m = engram_multipliers(v41_flash().engram)
    assert m.dtype == np.int64
    np.testing.assert_array_equal(m, np.array(REL_MULTS, np.int64))
    assert (m % 2 == 1).all()


# ---------------------------------------------------------------------------------------------------
# token map


@pytest.fixture(scope="module")
def golden():
    if not (GOLDEN / "inputs.npz").exists():
        pytest.skip(f"golden data not found at {GOLDEN}")
    inp = dict(np.load(GOLDEN / "inputs.npz"))
    ref = dict(np.load(GOLDEN / "ref_fp32.npz"))
    return inp, ref


@pytest.fixture(scope="module")
def token_map():
    pytest.importorskip("tokenizers")
    path = GOLDEN / "tiny_hf" / "tokenizer.json"
    if not path.exists():
        pytest.skip(f"golden tokenizer not found at {path}")
    return build_token_map(path)


@needs_golden
def test_token_map_matches_golden(token_map, golden):
    inp, _ = golden
    assert token_map.dtype == np.int64 and token_map.shape == (512,)
    np.testing.assert_array_equal(token_map, inp["engram_token_map"])
    assert np.unique(token_map).size == 391
    np.testing.assert_array_equal(token_map[:3], [0, 1, 2])
    check_token_map(token_map, tiny().engram)
    with pytest.raises(ValueError, match="compressed_vocab_size"):
        check_token_map(token_map, v41_flash().engram)


# ---------------------------------------------------------------------------------------------------
# row ids against the reference


@needs_golden
@pytest.mark.parametrize("tag", ["batch1", "batch2"])
def test_prefill_and_decode_rows_match_golden(tag, token_map, golden):
    inp, ref = golden
    cfg = tiny().engram
    hasher = EngramHasher(cfg, token_map)
    ids = inp[f"{tag}_ids"]
    rows, hist = hasher.row_ids(ids, None)
    b, s = ids.shape
    assert rows.dtype == np.int64 and rows.shape == (b, s, 2, 6)
    np.testing.assert_array_equal(rows, ref[f"{tag}_engram_row_ids"])
    np.testing.assert_array_equal(hist.n_seen, [s] * b)

    dec_ids = ref[f"{tag}_decode_input_ids"]
    steps = []
    for i in range(dec_ids.shape[1]):
        r, hist = hasher.row_ids(dec_ids[:, i:i + 1], None, hist)
        steps.append(r[:, 0])
    np.testing.assert_array_equal(np.stack(steps, 1), ref[f"{tag}_decode_engram_row_ids"])

    # dropping the carry must change the decode rows (spec model §6.5)
    r0, _ = hasher.row_ids(dec_ids[:, :1], None, None)
    assert not np.array_equal(r0[:, 0], ref[f"{tag}_decode_engram_row_ids"][:, 0])


@needs_golden
def test_chunked_prefill_equals_one_shot(token_map, golden):
    inp, _ = golden
    hasher = EngramHasher(tiny().engram, token_map)
    ids = inp["batch2_ids"]
    full, hist_full = hasher.row_ids(ids, None)
    parts, hist = [], hasher.history_init(ids.shape[0])
    for lo, hi in [(0, 2), (2, 71), (71, ids.shape[1])]:  # first chunk shorter than max_ngram_size-1
        r, hist = hasher.row_ids(ids[:, lo:hi], None, hist)
        parts.append(r)
    np.testing.assert_array_equal(np.concatenate(parts, 1), full)
    np.testing.assert_array_equal(hist.ids, hist_full.ids)
    np.testing.assert_array_equal(hist.n_seen, hist_full.n_seen)


# ---------------------------------------------------------------------------------------------------
# independent per-position evaluation of spec model §6.5


def _rows_loop(tok, dead, cfg, token_map):
    """Plain transcription of spec model §6.5, one position at a time, Python integers masked to int64."""
    primes = engram_primes(cfg).reshape(len(cfg.layer_ids), -1).tolist()
    offs = engram_offsets(cfg).tolist()
    mults = engram_multipliers(cfg).tolist()
    pad = int(token_map[cfg.pad_id])
    bsz, seq = tok.shape
    out = np.zeros((bsz, seq, len(cfg.layer_ids), cfg.n_columns), np.int64)
    for b in range(bsz):
        hist = [DEAD if dead[b, p] else int(token_map[tok[b, p]]) for p in range(seq)]
        for p in range(seq):
            for li in range(len(cfg.layer_ids)):
                blocked, hs, h = False, [], 0
                for k in range(cfg.max_ngram_size):
                    blocked = blocked or p < k or hist[p - k] == DEAD
                    t = pad if blocked else hist[p - k]
                    prod = (t * mults[li][k]) & 0xFFFFFFFFFFFFFFFF
                    if prod >= 2**63:
                        prod -= 2**64
                    h = prod if k == 0 else h ^ prod
                    if k >= 1:
                        hs.append(h)
                for n in range(2, cfg.max_ngram_size + 1):
                    for head in range(cfg.n_heads):
                        c = (n - 2) * cfg.n_heads + head
                        out[b, p, li, c] = hs[n - 2] % primes[li][c] + offs[li][c]
    return out


@pytest.mark.parametrize("preset", [tiny, v41_flash])
def test_vectorised_equals_loop_with_dead_span(preset):
    cfg = preset().engram
    rng = np.random.default_rng(0)
    vocab = 2000
    # a synthetic map with pad at id cfg.pad_id and ids spread over the compressed vocabulary
    token_map = rng.integers(0, cfg.compressed_vocab_size, size=vocab).astype(np.int64)
    token_map[:3] = [0, 1, 2]
    bsz, seq = 3, 40
    tok = rng.integers(0, vocab, size=(bsz, seq))
    dead = np.zeros((bsz, seq), bool)
    dead[0, 15:22] = True  # image span in the middle
    dead[1, 1:3] = True  # span right after the start
    dead[2, 20] = True  # a one-token span
    ref = _rows_loop(tok, dead, cfg, token_map)
    hasher = EngramHasher(cfg, token_map)
    rows, _ = hasher.row_ids(tok, dead)
    np.testing.assert_array_equal(rows, ref)
    np.testing.assert_array_equal(row_ids(tok, dead, cfg, token_map)[0], ref)

    # chunked with a boundary inside the DEAD span and one right after it
    parts, hist = [], history_init(bsz, cfg)
    for lo, hi in [(0, 18), (18, 22), (22, 23), (23, seq)]:
        r, hist = hasher.row_ids(tok[:, lo:hi], dead[:, lo:hi], hist)
        parts.append(r)
    np.testing.assert_array_equal(np.concatenate(parts, 1), ref)

    # n-grams never cross the span: the position right after it hashes like a sequence start
    np.testing.assert_array_equal(rows[0, 22], hasher.row_ids(tok[:1, 22:23], None)[0][0, 0])
    # ... and a token 2 after the span sees only pad beyond the span, whatever precedes it
    tok2 = tok.copy()
    tok2[0, :22] = rng.integers(0, vocab, size=22)
    np.testing.assert_array_equal(hasher.row_ids(tok2, dead)[0][0, 22:], rows[0, 22:])
    # the sequence start likewise: position 0 sees only pad before it, as after a DEAD token
    np.testing.assert_array_equal(rows[:, 0], hasher.row_ids(tok[:, :1], None)[0][:, 0])
    # rows stay inside each column's bucket range
    primes = engram_primes(cfg).reshape(len(cfg.layer_ids), -1)
    offs = engram_offsets(cfg)
    assert ((rows >= offs) & (rows < offs + primes)).all()
