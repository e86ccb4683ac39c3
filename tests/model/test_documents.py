"""Document masking of packed rows (dsv41_jax.model.documents): the compressed-entry layout against a loop
(and, for one document, the plain row layout), a packed document computes what it computes alone at the
start of a row (at odd offsets, with top-k and the candidate pool binding), and nothing flows between
documents (by perturbation and by gradient)."""

from __future__ import annotations

import dataclasses

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
    e = jax.jit(lambda seg, pos: entries(documents(seg, pos), m, *seg.shape))(jnp.asarray(seg), pos)
    for b, (firsts, lo, hi) in enumerate(_layout_oracle(seg, m)):
        n = len(firsts)
        np.testing.assert_array_equal(np.asarray(e.first[b, :n]), firsts)
        np.testing.assert_array_equal(np.asarray(e.positions[b, :n]), np.asarray(pos[b])[firsts])
        np.testing.assert_array_equal(np.asarray(e.lo[b]), lo)
        np.testing.assert_array_equal(np.asarray(e.hi[b]), hi)
    # one document per row is the plain row layout: entry j at row j·m, visible iff j < (p+1) div m
    one, plain = jax.jit(lambda seg: (entries(documents(seg), m, 2, 24), entries(None, m, 2, 24)))(
        jnp.ones((2, 24), jnp.int32))
    np.testing.assert_array_equal(np.asarray(one.first), np.asarray(plain.positions))
    np.testing.assert_array_equal(np.asarray(one.hi), np.asarray(plain.hi))
    assert not np.asarray(one.lo).any()


@pytest.fixture(scope="module")
def cfg6(tiny_cfg):
    """The tiny model cut to 6 layers, still one of each role: SWA with Engram (0), Full m=2 (1), Reuse m=2 (2),
    Full m=1 candidate source with Engram (3), Reindex restricted to the candidates (4), Reuse m=1 (5)."""
    a, d = tiny_cfg.attention, tiny_cfg.dspark
    attention = dataclasses.replace(a, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0, 0), kv_source_layers=(1, 3),
                                    index_source_layers=(1, 3, 4), candidate_source_layer=3)
    return tiny_cfg.replace(n_layers=6, attention=attention,
                            engram=dataclasses.replace(tiny_cfg.engram, layer_ids=(0, 3)),
                            dspark=dataclasses.replace(d, target_layer_ids=(3, 4, 5)))


@pytest.fixture(scope="module")
def packed(cfg6):
    """The 6-layer model on one row; ``run(tokens, rows, seg) -> (logits, |d loss(document 2) / d embeddings|)``
    is one compiled program for every test here."""
    cfg = cfg6
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for block in model.layers:  # non-trivial sinks
        block.attn.attn_sink[...] = jnp.asarray(rng.normal(size=block.attn.attn_sink.shape), jnp.float32)
    tokens = rng.integers(0, cfg.vocab_size, (1, S))
    rows = np.stack([rng.integers(0, n, (1, S, cfg.engram.n_columns)) for n in cfg.engram.num_embeddings],
                    axis=2).astype(np.int32)
    graphdef, state = nnx.split(model)

    def loss(h, rows, seg, targets):  # log-likelihood of document 2's tokens
        logits = nnx.merge(graphdef, state).forward_embeddings(h, rows, segment_ids=seg)
        lp = jax.nn.log_softmax(logits[0, OFF[1]:OFF[2] - 1])
        return jnp.take_along_axis(lp, targets[:, None], axis=-1).sum(), logits

    grad = jax.jit(jax.grad(loss, has_aux=True))

    def run(tokens, rows, seg):
        h = jnp.take(model.embed.weight[...], jnp.asarray(tokens), axis=0)
        g, logits = grad(h, rows, seg, jnp.asarray(tokens[0, OFF[1] + 1:OFF[2]]))
        return np.asarray(logits)[0], np.abs(np.asarray(g)[0]).sum(-1)

    seg = np.repeat(np.arange(1, len(LENS) + 1), LENS)[None]
    return dict(cfg=cfg, tokens=tokens, rows=rows, seg=seg, run=run, packed=run(tokens, rows, seg))


def test_packed_documents_equal_alone(packed):
    """Each document of a packed row gives the logits it gives alone at the start of a row (fp32)."""
    p = packed
    got = p["packed"][0]
    for d, n in enumerate(LENS):  # document d at the start of a row, the rest padding
        tokens, rows = np.zeros_like(p["tokens"]), np.zeros_like(p["rows"])
        tokens[0, :n], rows[0, :n] = p["tokens"][0, OFF[d]:OFF[d + 1]], p["rows"][0, OFF[d]:OFF[d + 1]]
        want = p["run"](tokens, rows, (np.arange(S) < n)[None].astype(np.int32))[0]
        np.testing.assert_allclose(got[OFF[d]:OFF[d + 1]], want[:n], rtol=1e-5, atol=2e-5)
    # control: as one document the later documents see the earlier ones
    leaky = p["run"](p["tokens"], p["rows"], np.ones_like(p["seg"]))[0]
    assert np.abs(leaky[OFF[1]:] - got[OFF[1]:]).max() > 1e-2


def test_perturbing_a_document_leaves_the_others_bit_identical(packed):
    p = packed
    rng = np.random.default_rng(7)
    tokens, rows = p["tokens"].copy(), p["rows"].copy()
    tokens[0, OFF[1]:OFF[2]] = rng.integers(0, p["cfg"].vocab_size, LENS[1])
    rows[0, OFF[1]:OFF[2]] = rows[0, OFF[1]:OFF[2]][::-1]
    a, b = p["packed"][0], p["run"](tokens, rows, p["seg"])[0]
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
