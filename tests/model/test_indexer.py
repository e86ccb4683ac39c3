"""Lightning-indexer scores, hierarchical candidate blocks and top-k selection (spec attention §3.5, §6).

Oracles are plain numpy per query: candidate blocks follow §6.1 step by step, top-k sorts explicitly
with ties to the lower index, and scores are Σ_h w_h·ReLU(q_h·k_t) with a complex-number RoPE and the
library's MXFP4 fake-quant (``quant.qdq_mxfp4``, tested on its own in tests/test_quant.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.model.indexer import (
    Indexer,
    block_mask,
    candidate_block_ids,
    expand_blocks,
    index_scores,
    select_topk,
    visible_scores,
)
from dsv41_jax.model.rope import rope_frequencies

NEG_INF = -np.inf



def candidate_blocks(scores, n_visible, block_size, n_blocks):
    """The kept blocks as a per-block mask over all ``ceil(T / block_size)`` blocks."""
    ids = candidate_block_ids(scores, n_visible, block_size, n_blocks)
    return block_mask(ids, -(-scores.shape[-1] // block_size))


candidate_jit = jax.jit(candidate_blocks, static_argnames=("block_size", "n_blocks"))
topk_jit = jax.jit(select_topk, static_argnames=("k",))


# --------------------------------------------------------------------------------------------------
# candidate blocks


def candidate_oracle(row: np.ndarray, n_p: int, bs: int, n_blocks: int) -> np.ndarray:
    t = row.shape[0]
    nb = -(-t // bs)
    padded = np.concatenate([row, np.full(nb * bs - t, NEG_INF)])  # 1. pad with −∞
    block = [padded[i * bs:(i + 1) * bs].max() for i in range(nb)]  #    block score = max
    if n_p > 0:
        block[(n_p - 1) // bs] = np.inf  # 2. pin the newest visible block
    order = sorted(range(nb), key=lambda i: (-block[i], i))[:min(n_blocks, nb)]  # 3. top blocks, ties → lower
    keep = np.zeros(nb, bool)
    for i in order:
        keep[i] = block[i] > NEG_INF  # 4. only blocks with a score > −∞
    return keep


def causal_scores(rng, b, s, t, ratio, levels=4, frac_hole=0.15):
    """Integer scores (many ties), −∞ at t ≥ n_p = (p+1)//ratio, some −∞ holes inside the visible range."""
    scores = rng.integers(0, levels, size=(b, s, t)).astype(np.float32)
    n_vis = np.broadcast_to((np.arange(s) + 1) // ratio, (b, s)).copy()
    scores[rng.random((b, s, t)) < frac_hole] = NEG_INF
    scores = np.where(np.arange(t) < n_vis[..., None], scores, NEG_INF).astype(np.float32)
    return scores, n_vis


@pytest.mark.parametrize("ratio,t,bs,n_blocks", [(1, 30, 4, 3), (2, 13, 4, 2), (1, 30, 4, 16), (1, 7, 8, 2)])
def test_candidate_blocks_equal_spec_loop(rng, ratio, t, bs, n_blocks):
    s = t * ratio + ratio - 1  # queries past the last position too, so every n_p from 0 to T occurs
    scores, n_vis = causal_scores(rng, 2, s, t, ratio)
    # a few rows with arbitrary visibility, including n_p = 0 and a fully visible row
    n_vis[1, :3] = [0, t, 1]
    scores[1, :3] = np.where(np.arange(t) < n_vis[1, :3, None], rng.integers(0, 4, (3, t)), NEG_INF)
    got = np.asarray(candidate_jit(jnp.asarray(scores), jnp.asarray(n_vis, jnp.int32), block_size=bs,
                                   n_blocks=n_blocks))
    want = np.stack([np.stack([candidate_oracle(scores[b, i], n_vis[b, i], bs, n_blocks) for i in range(s)])
                     for b in range(2)])
    np.testing.assert_array_equal(got, want)
    assert (n_vis == 0).any() and not got[n_vis == 0].any()  # nothing visible → nothing kept
    mask = np.asarray(expand_blocks(jnp.asarray(got), bs, t))
    np.testing.assert_array_equal(mask, np.repeat(want, bs, axis=-1)[..., :t])


def test_candidate_blocks_pin_beats_older_full_blocks():
    # block 2 holds only the newest entry with a low score; it is pinned and survives n_blocks = 1
    scores = np.array([[[5, 5, 5, 5, 4, 4, 4, 4, 0, NEG_INF, NEG_INF, NEG_INF]]], np.float32)
    got = np.asarray(candidate_jit(jnp.asarray(scores), jnp.asarray([[9]], jnp.int32), block_size=4, n_blocks=2))
    np.testing.assert_array_equal(got[0, 0], [True, False, True])
    got = np.asarray(candidate_jit(jnp.asarray(scores), jnp.asarray([[9]], jnp.int32), block_size=4, n_blocks=1))
    np.testing.assert_array_equal(got[0, 0], [False, False, True])


def test_candidate_block_ties_go_to_lower_index():
    scores = np.array([[[1, 1, 3, 3, 1, 1, 3, 3, 2, 2, 2, 2, 0, 0, 0, 0]]], np.float32)
    # pinned block 3 (n_p = 16), then blocks 0 and 1 tie at 3: block 0 wins the last slot
    got = np.asarray(candidate_jit(jnp.asarray(scores), jnp.asarray([[16]], jnp.int32), block_size=4, n_blocks=2))
    np.testing.assert_array_equal(got[0, 0], [True, False, False, True])


# --------------------------------------------------------------------------------------------------
# top-k


def topk_oracle(row: np.ndarray, k: int, n_p: int) -> np.ndarray:
    t = row.shape[0]
    best = sorted(range(t), key=lambda i: (-row[i], i))[:min(k, t)]
    return np.array([i if i < n_p else -1 for i in sorted(best)], np.int32)


@pytest.mark.parametrize("t,k,ratio", [(13, 5, 1), (13, 5, 2), (3, 5, 1), (16, 16, 1)])
def test_select_topk_equals_sorted_oracle(rng, t, k, ratio):
    s = t * ratio + 1
    scores, n_vis = causal_scores(rng, 2, s, t, ratio, levels=3)
    n_vis[1, 0] = 0
    scores[1, 0] = NEG_INF
    got = np.asarray(topk_jit(jnp.asarray(scores), k=k, n_visible=jnp.asarray(n_vis, jnp.int32)))
    assert got.shape == (2, s, min(k, t)) and got.dtype == np.int32
    want = np.stack([np.stack([topk_oracle(scores[b, i], k, n_vis[b, i]) for i in range(s)]) for b in range(2)])
    np.testing.assert_array_equal(got, want)
    # visible picks ascend; −1 only where the pick fell on an invisible position
    for b in range(2):
        for i in range(s):
            real = got[b, i][got[b, i] >= 0]
            assert (np.diff(real) > 0).all() and (real < n_vis[b, i]).all()


def test_select_topk_ties_lower_index_first():
    scores = np.array([[[2, 7, 7, 1, 7, 7, 0]]], np.float32)
    got = np.asarray(topk_jit(jnp.asarray(scores), k=3, n_visible=jnp.asarray([[7]], jnp.int32)))
    np.testing.assert_array_equal(got[0, 0], [1, 2, 4])
    got = np.asarray(topk_jit(jnp.asarray(scores), k=3, n_visible=jnp.asarray([[4]], jnp.int32)))
    np.testing.assert_array_equal(got[0, 0], [1, 2, -1])


# --------------------------------------------------------------------------------------------------
# Indexer.scores


def rope_oracle(x, pos, freqs):
    """Interleaved-pair rotation of the trailing 2·len(freqs) lanes; x [B, S, N, D], float64."""
    rd = 2 * len(freqs)
    out = np.array(x, np.float64)
    z = out[..., -rd::2] + 1j * out[..., -rd + 1::2]
    z = z * np.exp(1j * pos[..., None, None].astype(np.float64) * freqs.astype(np.float64))
    out[..., -rd::2], out[..., -rd + 1::2] = z.real, z.imag
    return out


def mxfp4_margin(v: np.ndarray) -> float:
    """Smallest relative distance of a value from an MXFP4 rounding edge: an E2M1 midpoint of v/s, or a
    group amax/6 on a power of two (where the scale s would jump)."""
    g = np.asarray(v, np.float64).reshape(*np.shape(v)[:-1], -1, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 6 * 2.0**-126)
    e = np.log2(amax / 6)
    scale_margin = np.abs(e - np.round(e)) * np.log(2)
    y = np.abs(g) / 2.0 ** np.ceil(e)
    edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    elem_margin = np.abs(y[..., None] - edges).min(-1) / np.maximum(y, 1e-30)
    return float(min(elem_margin.min(), scale_margin.min()))


def test_indexer_scores_equal_formula(tiny_cfg, rng):
    a = tiny_cfg.attention
    dim, hi, di = tiny_cfg.dim, a.index_n_heads, a.index_head_dim
    idx = Indexer(a, dim, tiny_cfg.norm_eps, owns_keys=True, dtype=jnp.float32, param_dtype=jnp.float32,
                  rngs=nnx.Rngs(0))
    b, s, t = 2, 9, 11
    x = rng.normal(0, 1.0, (b, s, dim)).astype(np.float32)
    q_latent = rng.normal(0, 1.0, (b, s, a.q_lora_rank)).astype(np.float32)
    pos = (np.arange(s)[None] + np.array([[0], [17]])).astype(np.int32)  # batch 1 starts at 17
    index_k = quant.qdq_mxfp4(jnp.asarray(rng.normal(0, 1.0, (b, t, di)), jnp.float32))
    n_vis = rng.integers(0, t + 1, (b, s)).astype(np.int32)
    n_vis[0, 0], n_vis[1, -1] = 0, t
    freqs = rope_frequencies(a, "yarn")

    def scores(m, x, q_latent, pos, keys, n_vis):  # as Attention._select_scoped over a DenseKV
        iq, w = m.queries(x, q_latent, pos, freqs)
        return visible_scores(index_scores(iq, w, keys), n_vis)

    fun = nnx.jit(scores)
    got = np.asarray(fun(idx, jnp.asarray(x), jnp.asarray(q_latent), jnp.asarray(pos), index_k, jnp.asarray(n_vis)))

    wq = np.asarray(idx.wq_b.weight[...], np.float64)
    wp = np.asarray(idx.weights_proj.weight[...], np.float64)
    iq = (q_latent.astype(np.float64) @ wq.T).reshape(b, s, hi, di)
    iq = rope_oracle(iq, pos, freqs)
    # the library reaches these values in fp32 (≈1e-7 apart from float64); a value within that distance of
    # a rounding edge could legitimately quantise to the neighbouring code, so the data must keep clear
    assert mxfp4_margin(iq) > 1e-6, "test data sits on an MXFP4 rounding edge: change the seed"
    iq = np.asarray(quant.qdq_mxfp4(jnp.asarray(iq, jnp.float32)), np.float64)
    w = (x.astype(np.float64) @ wp.T) / np.sqrt(di * hi)
    k = np.asarray(index_k, np.float64)
    want = np.full((b, s, t), NEG_INF)
    scale = np.zeros((b, s))
    for bi in range(b):
        for si in range(s):
            for tt in range(n_vis[bi, si]):
                terms = [w[bi, si, h] * max(iq[bi, si, h] @ k[bi, tt], 0.0) for h in range(hi)]
                want[bi, si, tt] = sum(terms)
                scale[bi, si] = max(scale[bi, si], sum(abs(v) for v in terms))
    vis = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), vis)  # −∞ exactly at t ≥ n_visible
    assert (got[~vis] == NEG_INF).all()
    # weights can be negative, so terms cancel: the error budget is relative to Σ_h |term|
    budget = 1e-5 * (np.abs(want[vis]) + np.broadcast_to(scale[..., None], want.shape)[vis])
    err = np.abs(got[vis] - want[vis])
    assert (err <= budget).all(), f"worst error / budget = {(err / budget).max():.3g}"
    # the QDQ matters on this data: without it the scores differ beyond the tolerance
    raw = rope_oracle((q_latent.astype(np.float64) @ wq.T).reshape(b, s, hi, di), pos, freqs)
    unq = np.einsum("bsh,bsht->bst", w, np.maximum(np.einsum("bshd,btd->bsht", raw, k), 0))
    assert np.abs(unq[vis] - want[vis]).max() > 1e-2 * scale.max()


@pytest.mark.parametrize("b,s,t,k", [(2, 1, 700, 64), (3, 2, 300, 300), (1, 1, 5000, 512)])
def test_select_topk_by_radix_equals_top_k(rng, b, s, t, k):
    """The radix select picks what ``top_k`` picks on unrestricted causal scores: many ties (integer scores, the
    lower entry first), −∞ past each row's visible entries, rows with fewer visible entries than k."""
    scores = rng.integers(0, 5, size=(b, s, t)).astype(np.float32)
    n_vis = rng.integers(k // 2, t + 1, size=(b, s))
    scores = jnp.asarray(np.where(np.arange(t) < n_vis[..., None], scores, NEG_INF), jnp.float32)
    n_vis = jnp.asarray(n_vis, jnp.int32)
    want = np.asarray(select_topk(scores, k, n_vis))
    got = np.asarray(jax.jit(lambda sc, n: select_topk(sc, k, n, radix=True))(scores, n_vis))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="radix"):
        select_topk(scores, k, n_vis, n_vis * 0, radix=True)
