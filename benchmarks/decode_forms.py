"""Alternative XLA forms of a decode step's small per-layer ops, timed against the model's own.

    PYTHONPATH=. python benchmarks/decode_forms.py [--batches 1,32] [--entries 4096,65536] [--chain 16]

Each case runs ``--chain`` copies of the op back to back inside one jitted program (each copy's input
depends on the previous copy's output, so nothing is shared or reordered), as the 40 layers of a decode step
do, and reports µs per copy (median of 20 calls / chain): a single call's launch would otherwise swamp ops
of a few µs. The forms:

* ``index``: the index score ``Σ_h w_h·ReLU(q_h·k_t)`` over every entry (a KV source's full scan at decode):
  ``model`` = :func:`dsv41_jax.model.indexer.index_scores` (the head sum a matmul), ``reduce`` = the head sum
  as a multiply and a reduction (ReLU and the weights fused into it).
* ``mhc``: one mHC site at decode (coefficients with the unrolled Sinkhorn, collapse, RMS norm and expand
  of a sublayer's output): ``model`` = :mod:`dsv41_jax.model.mhc` (on GPU collapse and expand written out as
  sums over the M streams), ``products`` = collapse and expand as products (the CPU's and long chunks' form),
  ``reduce-mix`` = the model with the coefficients' matvec as a multiply and a reduction. (A Pallas kernel of
  the site was a fourth form until it measured 2× slower than the model's: BENCHMARKS.md.)
* ``attention``: the sparse MQA core of a decode step (one query row, its SWA ring of W keys, its own key
  and 512 picked entries gathered from the compressed keys, the sink): ``model`` =
  :func:`dsv41_jax.model.sparse.sparse_attention` (one softmax over three key parts), ``one-list`` = the three
  parts concatenated into one key list per query, one logits product, one masked softmax, one P·V.

One JSON line per case and form (``us_per_copy``; a site for ``mhc``) with the largest difference from
``model`` relative to its largest entry.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import config as Cfg
from dsv41_jax.model import indexer, mhc, sparse
from pallas_kernels.benchutil import median_us


def index_forms():
    def reduce(iq, w, keys):
        dots = jnp.einsum("bsni,bti->bsnt", iq, keys, preferred_element_type=jnp.float32)
        return jnp.sum(w[..., None] * jax.nn.relu(dots), axis=-2)

    return {"model": indexer.index_scores, "reduce": reduce}


MHC_FORMS = ("model", "products", "reduce-mix")


def mhc_site(cfg, form: str):
    """One site as the single-pass schedule runs it between two sublayers: ``X' = expand(F, X, post, comb)``,
    the next coefficients from ``X'``, ``u = norm(collapse(X', pre))``. ``site(carry, fn, base, scale, norm_w)``
    with ``carry = (X [B,1,M,D], pre, F [B,1,D], post, comb)`` returns ``(carry', X')``, ``F'`` being ``u``."""

    def collapse(x, pre):
        if form != "products":
            return mhc.collapse(x, pre)
        return jnp.einsum("bsm,bsmd->bsd", pre, x.astype(jnp.float32), precision="highest").astype(x.dtype)

    def expand(f, r, post, comb):
        if form != "products":
            return mhc.expand(f, r, post, comb)
        rf, ff = r.astype(jnp.float32), f.astype(jnp.float32)
        out = post[..., None] * ff[:, :, None, :] + jnp.einsum("bsmM,bsmd->bsMd", comb, rf, precision="highest")
        return out.astype(r.dtype)

    def mixes(x, fn, base, scale):
        if form != "reduce-mix":
            return mhc.hc_mixes(x, fn, base, scale, cfg.mhc, cfg.norm_eps)
        flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.norm_eps)
        return mhc.coefficients(jnp.sum(flat[..., None, :] * fn, -1) * r, base, scale, cfg.mhc)

    def norm(u, norm_w):
        u = u.astype(jnp.float32)
        return u * jax.lax.rsqrt(jnp.mean(u * u, -1, keepdims=True) + cfg.norm_eps) * norm_w

    def site(carry, fn, base, scale, norm_w):
        x, pre, f, post, comb = carry
        x2 = expand(f, x, post, comb)
        p_, post_, comb_ = mixes(x2, fn, base, scale)
        u = collapse(x2, pre)
        return (x2, p_, norm(u, norm_w).astype(x.dtype), post_, comb_), x2

    return site


def attention_forms(window: int):
    def model(q, kv, sink, ring, ring_pos, compressed, topk, start):
        return sparse.sparse_attention(q, kv, sink, window, compressed, topk, start=start, prefix_kv=ring,
                                       prefix_pos=ring_pos)

    def one_list(q, kv, sink, ring, ring_pos, compressed, topk, start):
        h = q.shape[-1]
        picked = sparse.gather_entries(compressed, jnp.maximum(topk, 0))  # [B, 1, K, H]
        keys = jnp.concatenate([jnp.broadcast_to(ring[:, None], (*ring.shape[:1], 1, *ring.shape[1:])),
                                kv[:, :, None], picked], axis=2)  # [B, 1, W + 1 + K, H]
        ok_ring = (ring_pos >= 0) & (ring_pos > start[:, None] - window)
        ok = jnp.concatenate([ok_ring[:, None], jnp.ones(kv.shape[:2] + (1,), bool), topk >= 0], axis=-1)
        logits = jnp.einsum("bsnh,bslh->bsnl", q, keys, preferred_element_type=jnp.float32) * h ** -0.5
        logits = jnp.where(ok[:, :, None, :], logits, -jnp.inf)
        mx = jnp.maximum(logits.max(-1, keepdims=True), sink[:, None])
        p = jnp.exp(logits - mx)
        den = p.sum(-1) + jnp.exp(sink - mx[..., 0])
        out = jnp.einsum("bsnl,bslh->bsnh", p.astype(q.dtype), keys, preferred_element_type=jnp.float32)
        return (out / den[..., None]).astype(q.dtype)

    return {"model": model, "one-list": one_list}


def chained(op, n: int):
    """``n`` copies of ``op(carry, fixed, *args_i)`` in one program; ``fixed`` is every copy's, the other
    arguments are stacked on a leading axis (arguments, not constants: large arrays stay out of the program)."""
    def run(carry, fixed, *stacked):
        outs = []
        for i in range(n):
            carry, out = op(carry, fixed, *(a[i] for a in stacked))
            outs.append(out)
        return carry, outs[-1]
    return jax.jit(run)


def time_forms(case: str, ops: dict, carry, fixed, *stacked, **fields) -> None:
    """One JSON line per form: µs a copy of ``chained(op)`` and its output's largest difference from the first
    form's (``model``), relative to that output's largest entry."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    base = None
    for name, op in ops.items():
        fn = chained(op, n)
        out = np.asarray(fn(carry, fixed, *stacked)[1], np.float32)
        base = out if base is None else base
        us = median_us(fn, carry, fixed, *stacked) / n
        print(json.dumps({"case": case, "form": name, **fields, "us_per_copy": round(us, 1),
                          "max_rel_diff": float(np.abs(out - base).max() / np.abs(base).max())}), flush=True)


def bench_index(cfg, rng, n: int, b: int, t: int) -> None:
    a = cfg.attention
    iq = jnp.asarray(rng.normal(0, 1, (n, b, 1, a.index_n_heads, a.index_head_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.1, (n, b, 1, a.index_n_heads)), jnp.float32)
    keys = jnp.asarray(rng.normal(0, 1, (b, t, a.index_head_dim)), jnp.bfloat16)

    def op_of(form):
        def op(k, _, q, w_):
            s = form(q, w_, k)  # the next copy's keys depend on this copy's scores
            return k + (s[:, 0, :, None] * 0).astype(k.dtype), s
        return op

    need = b * t * a.index_head_dim * 2 + b * t * 4
    time_forms("index", {name: op_of(f) for name, f in index_forms().items()}, keys, (), iq, w, batch=b,
               entries=t, keys_and_scores_MB=round(need / 1e6, 2))


def mhc_carry(cfg, rng, b: int, d: int):
    """A site's carry ``(X, pre, F, post, comb)`` at batch ``b`` and width ``d``: random streams and output,
    the coefficients of a fresh site (pre ½, post 1, comb a doubly stochastic matrix)."""
    m = cfg.mhc.hc_mult
    x = jnp.asarray(rng.normal(0, 1, (b, 1, m, d)), jnp.bfloat16)
    f = jnp.asarray(rng.normal(0, 1, (b, 1, d)), jnp.bfloat16)
    comb = mhc.sinkhorn(jnp.asarray(rng.normal(0, 1, (b, 1, m, m)), jnp.float32), cfg.mhc.hc_sinkhorn_iters,
                        cfg.mhc.hc_eps)
    return x, jnp.full((b, 1, m), 0.5, jnp.float32), f, jnp.ones((b, 1, m), jnp.float32), comb


def bench_mhc(cfg, rng, n: int, b: int, d: int = 2048) -> None:
    m = cfg.mhc.hc_mult
    stacked = (jnp.asarray(rng.normal(0, 0.02, (n, (2 + m) * m, m * d)), jnp.float32),
               jnp.zeros((n, (2 + m) * m), jnp.float32), jnp.ones((n, 3), jnp.float32), jnp.ones((n, d), jnp.float32))

    def op_of(site):
        def op(carry, _, *weights):
            return site(carry, *weights)
        return op

    time_forms("mhc", {name: op_of(mhc_site(cfg, name)) for name in MHC_FORMS}, mhc_carry(cfg, rng, b, d), (),
               *stacked, batch=b)


def bench_attention(cfg, rng, n: int, b: int, t: int) -> None:
    a = cfg.attention
    w_, h, heads, k = a.window_size, a.head_dim, a.n_heads, a.index_topk
    start = jnp.full((b,), 4 * t, jnp.int32)  # ratio-4-like: the entries end before the query
    q = jnp.asarray(rng.normal(0, 1, (n, b, 1, heads, h)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 1, (b, 1, h)), jnp.bfloat16)
    ring = jnp.asarray(rng.normal(0, 1, (b, w_, h)), jnp.bfloat16)
    ring_pos = jnp.broadcast_to(4 * t - w_ + jnp.arange(w_), (b, w_)).astype(jnp.int32)
    compressed = jnp.asarray(rng.normal(0, 1, (b, t, h)), jnp.bfloat16)
    topk = jnp.asarray(np.sort(np.stack([rng.choice(t, (n, 1, min(k, t)), replace=True) for _ in range(b)], 1), -1),
                       jnp.int32)
    sink = jnp.asarray(rng.normal(0, 1, (heads,)), jnp.float32)

    def op_of(form):
        def op(kv_, fixed, q_, tk):
            sink_, ring_, ring_pos_, compressed_, start_ = fixed
            o = form(q_, kv_, sink_, ring_, ring_pos_, compressed_, tk, start_)
            return kv_ + (o[:, :, :1, :] * 0).reshape(kv_.shape).astype(kv_.dtype), o
        return op

    time_forms("attention", {name: op_of(f) for name, f in attention_forms(w_).items()}, kv,
               (sink, ring, ring_pos, compressed, start), q, topk, batch=b, entries=t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,32")
    p.add_argument("--entries", default="4096,65536")
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--cases", default="index,mhc,attention")
    args = p.parse_args()
    cfg, n = Cfg.v41_flash(), args.chain
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "chain": n}), flush=True)
    rng = np.random.default_rng(0)
    cases = args.cases.split(",")
    entries = [int(v) for v in args.entries.split(",")]
    for b in (int(v) for v in args.batches.split(",")):
        for t in entries if "index" in cases else ():
            bench_index(cfg, rng, n, b, t)
        if "mhc" in cases:
            bench_mhc(cfg, rng, n, b)
        for t in entries if "attention" in cases else ():
            bench_attention(cfg, rng, n, b, t)


if __name__ == "__main__":
    main()
