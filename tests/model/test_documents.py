"""Document masking of packed rows (dsv41_jax.model.documents): the compressed-entry layout against a loop,
a packed document computes what it computes alone in a row (at odd offsets, with every selection binding),
and nothing flows between documents (by perturbation and by gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model import Transformer
from dsv41_jax.model.documents import documents, entries

LENS = (11, 45, 40)  # odd offsets 11 and 56; 45 > top-k (16) and > the candidate pool (8 blocks × 4)
S = sum(LENS)
OFF = np.cumsum((0,) + LENS)


def _layout_oracle(seg: np.ndarray, m: int):
    """Per row: (first row of each entry, lo and hi per query) by walking the documents one by one."""
    out = []
    for row in seg:
        firsts, lo, hi = [], np.zeros(len(row), int), np.zeros(len(row), int)
        r0 = 0
        while r0 < len(row):
            r1 = r0
            while r1 < len(row) and row[r1] == row[r0]:
                r1 += 1
            before = len(firsts)
            firsts += [r0 + j * m for j in range((r1 - r0) // m)]
            for r in range(r0, r1):
                lo[r], hi[r] = before, before + (r - r0 + 1) // m
            r0 = r1
        out.append((firsts, lo, hi))
    return out


@pytest.mark.parametrize("m", [1, 2])
def test_entry_layout_matches_a_loop(m, rng):
    runs = [np.repeat(np.arange(1, 6), rng.integers(1, 8, 5))[:24] for _ in range(3)]
    seg = np.stack([np.pad(r, (0, 24 - len(r))) for r in runs])  # a padding run (0) ends short rows
    seg[1, -3:] = 0
    pos = jnp.asarray(rng.integers(0, 99, seg.shape))  # RoPE positions are carried, not derived
    e = entries(documents(jnp.asarray(seg), pos), m, *seg.shape)
    for b, (firsts, lo, hi) in enumerate(_layout_oracle(seg, m)):
        n = len(firsts)
        np.testing.assert_array_equal(np.asarray(e.first[b, :n]), firsts)
        np.testing.assert_array_equal(np.asarray(e.positions[b, :n]), np.asarray(pos[b])[firsts])
        np.testing.assert_array_equal(np.asarray(e.lo[b]), lo)
        np.testing.assert_array_equal(np.asarray(e.hi[b]), hi)
    # one document per row is the plain row layout: entry j at row j·m, visible iff j < (p+1) div m
    one = entries(documents(jnp.ones((2, 24), jnp.int32)), m, 2, 24)
    plain = entries(None, m, 2, 24)
    np.testing.assert_array_equal(np.asarray(one.first), np.asarray(plain.positions))
    np.testing.assert_array_equal(np.asarray(one.hi), np.asarray(plain.hi))
    assert not np.asarray(one.lo).any()


@pytest.fixture(scope="module")
def packed(tiny8_cfg):
    """The tiny8 model on one packed row; ``run(h, seg) -> (logits, d loss(document 2) / d h)`` compiled once."""
    cfg = tiny8_cfg
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for block in model.layers:  # non-trivial sinks
        block.attn.attn_sink[...] = jnp.asarray(rng.normal(size=block.attn.attn_sink.shape), jnp.float32)
    tokens = rng.integers(0, cfg.vocab_size, (1, S))
    rows = np.stack([rng.integers(0, n, (1, S, cfg.engram.n_columns)) for n in cfg.engram.num_embeddings],
                    axis=2).astype(np.int32)
    graphdef, state = nnx.split(model)
    embed = lambda t: jnp.take(model.embed.weight[...], jnp.asarray(t), axis=0)

    def loss(h, rows, seg, targets):  # log-likelihood of document 2's tokens
        logits = nnx.merge(graphdef, state).forward_embeddings(h, rows, segment_ids=seg)
        lp = jax.nn.log_softmax(logits[0, OFF[1]:OFF[2] - 1])
        return jnp.take_along_axis(lp, targets[:, None], axis=-1).sum(), logits

    grad = jax.jit(jax.grad(loss, has_aux=True))
    seg = np.repeat(np.arange(1, len(LENS) + 1), LENS)[None]

    def run(tokens, rows, seg):
        g, logits = grad(embed(tokens), rows, seg, jnp.asarray(tokens[0, OFF[1] + 1:OFF[2]]))
        return np.asarray(logits), np.abs(np.asarray(g)[0]).sum(-1)

    plain = jax.jit(lambda t, r: nnx.merge(graphdef, state)(t, r))
    return dict(cfg=cfg, tokens=tokens, rows=rows, seg=seg, run=run, plain=plain, packed=run(tokens, rows, seg))


def test_packed_documents_equal_alone(packed):
    """Each document of a packed row gives the logits it gives alone from position 0 (fp32)."""
    p = packed
    got = p["packed"][0]
    n_doc = len(LENS)
    tokens, rows = np.zeros((n_doc + 1, S), np.int64), np.zeros((n_doc + 1, *p["rows"].shape[1:]), np.int32)
    for d, n in enumerate(LENS):  # each document at the start of its own row (causal: the tail is irrelevant)
        tokens[d, :n], rows[d, :n] = p["tokens"][0, OFF[d]:OFF[d + 1]], p["rows"][0, OFF[d]:OFF[d + 1]]
    tokens[n_doc], rows[n_doc] = p["tokens"][0], p["rows"][0]  # the packed row without segment ids
    want = np.asarray(p["plain"](tokens, rows))
    for d, n in enumerate(LENS):
        np.testing.assert_allclose(got[0, OFF[d]:OFF[d + 1]], want[d, :n], rtol=1e-5, atol=2e-5)
    # control: without segment ids the later documents see the earlier ones
    assert np.abs(want[n_doc, OFF[1]:OFF[2]] - want[1, :LENS[1]]).max() > 1e-2


def test_perturbing_a_document_leaves_the_others_bit_identical(packed):
    p = packed
    rng = np.random.default_rng(7)
    tokens, rows = p["tokens"].copy(), p["rows"].copy()
    tokens[0, OFF[1]:OFF[2]] = rng.integers(0, p["cfg"].vocab_size, LENS[1])
    rows[0, OFF[1]:OFF[2]] = rows[0, OFF[1]:OFF[2]][::-1]
    a, b = p["packed"][0][0], p["run"](tokens, rows, p["seg"])[0][0]
    np.testing.assert_array_equal(a[OFF[2]:], b[OFF[2]:])  # the next document: masked
    np.testing.assert_array_equal(a[:OFF[1]], b[:OFF[1]])  # the previous one: causal
    assert np.abs(a[OFF[1]:OFF[2]] - b[OFF[1]:OFF[2]]).max() > 1e-2


def test_no_gradient_crosses_documents(packed):
    """d loss(document 2's tokens) / d embeddings is exactly zero outside document 2, nonzero inside."""
    p = packed
    g = p["packed"][1]
    assert (g[:OFF[1]] == 0).all() and (g[OFF[2]:] == 0).all()
    assert (g[OFF[1]:OFF[2] - 1] > 0).all()
    # control: one document over the whole row, and the gradient reaches the earlier tokens
    g1 = p["run"](p["tokens"], p["rows"], np.ones_like(p["seg"]))[1]
    assert (g1[:OFF[1]] > 0).all()
