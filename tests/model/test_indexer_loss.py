"""Indexer KL and top-k agreement (dsv41_jax.model.indexer_loss) of one index-source layer against a float64
numpy oracle that lists each query's keys (window from its document start, visible entries of its document,
sink) and runs the softmax itself; and the indexer is detached: its loss trains the indexer only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model import Attention, DenseKV, Shared, Visibility
from dsv41_jax.model.documents import documents
from dsv41_jax.topology import layer_spec

LENS = (17, 23)  # two documents; the second's 23 ratio-1 entries exceed top-k 16, so the selection binds
S = sum(LENS)


def _layer(cfg, layer: int) -> Attention:
    spec = layer_spec(cfg, layer)
    assert spec.role == "full"
    attn = Attention(cfg.attention, spec, cfg.dim, cfg.norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
                     rngs=nnx.Rngs(layer))
    attn.attn_sink[...] = jnp.asarray(np.random.default_rng(layer).normal(size=attn.attn_sink.shape), jnp.float32)
    return attn


def _inputs(cfg):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, S, cfg.dim)), jnp.float32)
    seg = jnp.asarray(np.repeat([1, 2], LENS)[None])
    return x, seg


def _forward(attn: Attention, x, seg, target: str):
    """One compiled program: the layer's shared state and stats, its own q, window KV and index q/w (the
    oracle's inputs), and the gradient of the summed KL with respect to the layer's weights and its input."""
    graphdef, state = nnx.split(attn)

    def run(state, x, seg):
        attn = nnx.merge(graphdef, state)
        docs = documents(seg)
        vis = Visibility(docs.positions, docs=docs)
        _, shared = attn(x, Shared(DenseKV(qdq_main=attn.cfg.cache_quant.main_kv)), vis, indexer_target=target)
        q, q_latent = attn.query(x, docs.positions)
        iq, w = attn.indexer.queries(x, q_latent, docs.positions, attn.freqs)
        return shared.indexer.kl.sum(), (shared, (q, attn.window_kv(x, docs.positions), iq, w))

    (_, (shared, inputs)), grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(state, x, seg)
    return shared, inputs, grads


def _mass(q, window_keys, entries, sink, scale):
    """Σ_h P_h(entry): per head one softmax over the window keys, the entries and the sink."""
    logits = np.concatenate([window_keys, entries]) @ q.T * scale  # [K, N]
    top = np.maximum(logits.max(0), sink)
    e = np.exp(logits - top)
    return (e / (e.sum(0) + np.exp(sink - top)))[len(window_keys):].sum(1)


def _oracle(attn: Attention, seg, shared: Shared, inputs, target: str):
    """(kl, agreement) per query in float64 from the layer's own q, window KV, main KV and index q/k/w."""
    cfg, m = attn.cfg, attn.spec.ratio
    q, win, iq, w = (np.asarray(a, np.float64)[0] for a in inputs)
    ik = np.asarray(shared.kv.index, np.float64)[0]
    main = np.asarray(shared.kv.main, np.float64)[0]
    sink = np.asarray(attn.attn_sink[...], np.float64)
    topk = np.asarray(shared.topk)[0]
    scale = cfg.head_dim ** -0.5
    kls, agree = np.zeros(S), np.zeros(S)
    for i in range(S):
        d = int(seg[0, i]) - 1
        r0 = sum(LENS[:d])
        lo = sum(n // m for n in LENS[:d])
        vis = np.arange(lo, lo + (i - r0 + 1) // m)
        if len(vis) == 0:
            continue
        keys = win[max(r0, i - cfg.window_size + 1): i + 1]
        scores = (w[i][:, None] * np.maximum(iq[i] @ ik.T, 0)).sum(0)  # Σ_h w_h·ReLU(q_h·k_t)
        picks = topk[i][topk[i] >= 0]
        support = vis if target == "dense" else picks
        p = _mass(q[i], keys, main[support], sink, scale)
        p = p / p.sum()
        sc = scores[support] - scores[support].max()
        log_q = sc - np.log(np.exp(sc).sum())
        kls[i] = (p * (np.log(p) - log_q)).sum()
        dense = _mass(q[i], keys, main[vis], sink, scale)
        agree[i] = dense[np.isin(vis, picks)].sum() / dense.sum()
    return kls, agree


@pytest.mark.parametrize("layer, target", [(2, "dense"), (6, "topk")])
def test_kl_and_agreement_match_numpy(tiny_cfg, layer, target):
    """Per query against the oracle; and the KL trains the indexer only: its gradient reaches every indexer
    weight and nothing else (not the main attention, not the layer input)."""
    attn = _layer(tiny_cfg, layer)
    x, seg = _inputs(tiny_cfg)
    shared, inputs, (g_params, g_x) = _forward(attn, x, seg, target)
    kl, agree = _oracle(attn, seg, shared, inputs, target)
    st = shared.indexer
    np.testing.assert_allclose(np.asarray(st.kl)[0], kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(st.agreement)[0], agree, rtol=1e-5, atol=1e-6)
    valid = np.asarray(st.valid)[0]
    assert valid.sum() > S - 2 * attn.spec.ratio and kl.max() > 0.05  # the first token of a document sees none
    assert 0 < agree[valid].min() and agree.max() <= 1 + 1e-6
    if attn.spec.ratio == 1:  # the selection binds in document 2: some (dense) mass falls outside it
        assert agree[LENS[0] + 16:].min() < 1 - 1e-3
    flat = {".".join(map(str, p)): np.abs(np.asarray(g)).max() for p, g in nnx.to_flat_state(g_params)}
    indexer = {k for k in flat if k.startswith("indexer.")}
    assert indexer and all(flat[k] > 0 for k in indexer), flat
    assert all(flat[k] == 0 for k in set(flat) - indexer), flat
    assert not np.asarray(g_x).any()
