"""Single-Pass mHC coefficient math, Sinkhorn, collapse and expand (spec model §4.2–§4.3).

Oracles are plain float64 numpy written straight from the spec text: explicit loops over tokens and
over source/destination streams, and the Sinkhorn steps spelled out one normalisation at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import MHCConfig
from dsv41_jax.model import mhc
from dsv41_jax.model.mhc import collapse, expand, hc_mixes, sinkhorn

CFG = MHCConfig()  # hc_mult 4, 20 Sinkhorn iterations, hc_eps 1e-6
NORM_EPS = 1e-20

sinkhorn_jit = jax.jit(sinkhorn, static_argnames=("iters", "eps"))


def sinkhorn_oracle(logits: np.ndarray, iters: int = 20, eps: float = 1e-6) -> np.ndarray:
    """Spec §4.2 steps 6–7 for one [n, n] matrix: row softmax + eps, a column normalisation, then
    (iters − 1) × (row, column), every denominator + eps."""
    n = logits.shape[0]
    c = np.zeros((n, n))
    for i in range(n):
        row = np.exp(logits[i] - logits[i].max())
        c[i] = row / row.sum() + eps

    def columns(c):
        out = c.copy()
        for j in range(n):
            out[:, j] = c[:, j] / (c[:, j].sum() + eps)
        return out

    def rows(c):
        out = c.copy()
        for i in range(n):
            out[i] = c[i] / (c[i].sum() + eps)
        return out

    c = columns(c)
    for _ in range(iters - 1):
        c = columns(rows(c))
    return c


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def hc_mixes_oracle(x, fn, base, scale, n=4, eps=1e-6, norm_eps=1e-20, iters=20):
    """Spec §4.2 per token, float64."""
    b, s = x.shape[:2]
    pre, post, comb = np.zeros((b, s, n)), np.zeros((b, s, n)), np.zeros((b, s, n, n))
    for bi in range(b):
        for si in range(s):
            xbar = np.concatenate([x[bi, si, c] for c in range(n)]).astype(np.float64)  # stream-major
            r = 1.0 / np.sqrt(np.mean(xbar ** 2) + norm_eps)
            m = (fn.astype(np.float64) @ xbar) * r
            for c in range(n):
                pre[bi, si, c] = sigmoid(m[c] * scale[0] + base[c]) + eps
                post[bi, si, c] = 2 * sigmoid(m[n + c] * scale[1] + base[n + c])
            logits = np.array([[m[2 * n + n * i + j] * scale[2] + base[2 * n + n * i + j] for j in range(n)]
                               for i in range(n)])
            comb[bi, si] = sinkhorn_oracle(logits, iters, eps)
    return pre, post, comb


# --------------------------------------------------------------------------------------------------
# Sinkhorn


@pytest.mark.parametrize("magnitude", [0.1, 0.5, 1.0, 3.0, 30.0, 1000.0])
def test_sinkhorn_equals_spec_loop(rng, magnitude):
    logits = (rng.standard_normal((64, 4, 4)) * magnitude).astype(np.float32)
    got = np.asarray(sinkhorn_jit(jnp.asarray(logits), iters=20, eps=1e-6))
    want = np.stack([sinkhorn_oracle(lg.astype(np.float64)) for lg in logits])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_unrolled_sinkhorn_is_the_loop(rng):
    """``unroll`` writes the loop out: the same normalisations in the same order, and the spec's values."""
    logits = jnp.asarray(rng.standard_normal((2, 16, 4, 4)) * 3, jnp.float32)
    looped, unrolled = (jax.jit(lambda x, u=u: sinkhorn(x, 20, 1e-6, unroll=u))(logits) for u in (False, True))
    np.testing.assert_allclose(unrolled, looped, rtol=1e-6, atol=1e-7)
    want = np.stack([sinkhorn_oracle(lg.astype(np.float64)) for lg in np.asarray(logits).reshape(-1, 4, 4)])
    np.testing.assert_allclose(np.asarray(unrolled).reshape(-1, 4, 4), want, rtol=1e-5, atol=1e-6)


def test_hc_mixes_unrolls_only_few_matrices_on_gpu(rng, monkeypatch):
    """The loop is written out on GPU for at most ``sinkhorn_unroll_rows`` matrices (a decode step), and kept
    for more (training, prefill), for 0, and on CPU and TPU."""
    import dataclasses

    from dsv41_jax.model import mhc

    fn, base, scale = (jnp.zeros(s, jnp.float32) for s in ((24, 16), (24,), (3,)))

    def loops(rows, backend, cfg=CFG):
        monkeypatch.setattr(mhc.jax, "default_backend", lambda: backend)
        x = jnp.zeros((1, rows, 4, 4), jnp.float32)
        jaxpr = jax.make_jaxpr(lambda x: hc_mixes(x, fn, base, scale, cfg, NORM_EPS))(x).jaxpr
        # a scan unrolled by its length is one trip (XLA removes the loop): only shorter unrolls loop
        return any(e.primitive.name == "while"
                   or (e.primitive.name == "scan" and e.params["unroll"] < e.params["length"]) for e in jaxpr.eqns)

    assert not loops(1, "gpu") and not loops(CFG.sinkhorn_unroll_rows, "gpu")
    assert loops(CFG.sinkhorn_unroll_rows + 1, "gpu") and loops(1, "cpu") and loops(1, "tpu")
    assert loops(1, "gpu", dataclasses.replace(CFG, sinkhorn_unroll_rows=0))


@pytest.mark.parametrize("magnitude", [0.05, 0.3, 0.5])
def test_sinkhorn_doubly_stochastic_moderate_logits(rng, magnitude):
    logits = (rng.standard_normal((4096, 4, 4)) * magnitude).astype(np.float32)
    c = np.asarray(sinkhorn_jit(jnp.asarray(logits), iters=20, eps=1e-6)).astype(np.float64)
    assert (c > 0).all()
    np.testing.assert_allclose(c.sum(-1), 1.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(c.sum(-2), 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("magnitude", [30.0, 1e3, 1e5])
def test_sinkhorn_doubly_stochastic_large_permutation_logits(rng, magnitude):
    """Large logits whose row maxima sit in distinct columns: softmax is (up to eps) a permutation,
    already doubly stochastic, and must stay so without overflow."""
    perms = np.stack([np.eye(4)[rng.permutation(4)] for _ in range(512)])
    logits = (perms * magnitude + rng.standard_normal((512, 4, 4))).astype(np.float32)
    c = np.asarray(sinkhorn_jit(jnp.asarray(logits), iters=20, eps=1e-6)).astype(np.float64)
    assert np.isfinite(c).all()
    np.testing.assert_allclose(c.sum(-1), 1.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(c.sum(-2), 1.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(c, perms, rtol=0, atol=1e-5)


@pytest.mark.parametrize("magnitude", [1.0, 10.0, 1e3, 1e5])
def test_sinkhorn_columns_always_normalised(rng, magnitude):
    """The last step is a column normalisation, so columns sum to 1 (up to eps) for any logits.

    Rows are not asserted here: for generic large logits (several row maxima in one column) the spec's
    fixed 20 iterations do not converge, row sums stay off by up to ~8 %, and the library matches the
    spec loop there too (test_sinkhorn_equals_spec_loop)."""
    logits = (rng.standard_normal((2048, 4, 4)) * magnitude).astype(np.float32)
    c = np.asarray(sinkhorn_jit(jnp.asarray(logits), iters=20, eps=1e-6)).astype(np.float64)
    assert np.isfinite(c).all() and (c > 0).all()
    np.testing.assert_allclose(c.sum(-2), 1.0, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# hc_mixes, collapse, expand


@pytest.fixture(params=["written out", "products"])
def form(request, monkeypatch):
    """collapse and expand in both forms: sums written out over the streams (few rows) and products."""
    monkeypatch.setattr(mhc, "_written_out", lambda x: request.param == "written out")  # GPU's choice at decode
    return request.param


def random_site(rng, n=4, d=48):
    fn = (rng.standard_normal(((2 + n) * n, n * d)) / np.sqrt(n * d)).astype(np.float32)
    base = rng.standard_normal((2 + n) * n).astype(np.float32)
    scale = rng.uniform(0.3, 2.0, size=3).astype(np.float32)
    return fn, base, scale


def test_hc_mixes_equals_spec(rng):
    n, d = 4, 48
    fn, base, scale = random_site(rng, n, d)
    # streams of very different magnitude: the rsqrt statistic is joint over all n·d values
    x = (rng.standard_normal((2, 5, n, d)) * np.array([0.2, 1.0, 3.0, 7.0])[:, None]).astype(np.float32)
    fun = jax.jit(lambda x, fn, b, s: hc_mixes(x, fn, b, s, CFG, NORM_EPS))
    pre, post, comb = (np.asarray(v) for v in fun(jnp.asarray(x), jnp.asarray(fn), jnp.asarray(base),
                                                   jnp.asarray(scale)))
    wpre, wpost, wcomb = hc_mixes_oracle(x, fn, base, scale)
    np.testing.assert_allclose(pre, wpre, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(post, wpost, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(comb, wcomb, rtol=1e-5, atol=1e-6)
    # pre is not normalised and carries +hc_eps; post lies in (0, 2)
    assert not np.allclose(pre.sum(-1), 1.0, atol=1e-3)
    assert (post > 0).all() and (post < 2).all()


def test_hc_mixes_scale_invariance(rng):
    """m = (fn·x̄)·rsqrt(mean x̄²): scaling every stream of a token by the same factor changes nothing."""
    n, d = 4, 48
    fn, base, scale = random_site(rng, n, d)
    x = rng.standard_normal((1, 3, n, d)).astype(np.float32)
    fun = jax.jit(lambda x: hc_mixes(x, jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), CFG, NORM_EPS))
    a = fun(jnp.asarray(x))
    b = fun(jnp.asarray(x * np.float32(64.0)))  # a power of two keeps the scaling exact
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)



def test_collapse_equals_spec(rng, form):
    x = rng.standard_normal((2, 5, 4, 24)).astype(np.float32)
    pre = rng.uniform(0, 1.5, size=(2, 5, 4)).astype(np.float32)
    got = np.asarray(collapse(jnp.asarray(x), jnp.asarray(pre)))  # eager: each form traced afresh
    want = np.zeros((2, 5, 24))
    for b in range(2):
        for s in range(5):
            for c in range(4):
                want[b, s] += float(pre[b, s, c]) * x[b, s, c].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_expand_equals_spec_source_rows_destination_columns(rng, form):
    b, s, n, d = 2, 3, 4, 24
    f = rng.standard_normal((b, s, d)).astype(np.float32)
    resid = (rng.standard_normal((b, s, n, d)) * np.arange(1, n + 1)[:, None]).astype(np.float32)
    post = rng.uniform(0, 2, size=(b, s, n)).astype(np.float32)
    comb = rng.uniform(0, 1, size=(b, s, n, n)).astype(np.float32)  # deliberately not symmetric
    got = np.asarray(expand(*map(jnp.asarray, (f, resid, post, comb))))
    want = np.zeros((b, s, n, d))
    for bi in range(b):
        for si in range(s):
            for j in range(n):  # destination stream
                want[bi, si, j] = float(post[bi, si, j]) * f[bi, si].astype(np.float64)
                for i in range(n):  # source stream
                    want[bi, si, j] += float(comb[bi, si, i, j]) * resid[bi, si, i].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the transposed reading (row = destination) is a different answer on this data
    wrong = post[..., None] * f[:, :, None] + np.einsum("bsji,bsid->bsjd", comb, resid)
    assert np.abs(wrong - want).max() > 1e-1


def test_expand_convex_destinations(rng, form):
    """With comb from Sinkhorn, post = 0 and identical streams, every destination is (up to eps) the
    common stream: destination columns are convex combinations of the sources."""
    b, s, n, d = 1, 4, 4, 16
    logits = rng.standard_normal((b, s, n, n)).astype(np.float32) * 0.3
    comb = sinkhorn_jit(jnp.asarray(logits), iters=20, eps=1e-6)
    stream = rng.standard_normal((b, s, 1, d)).astype(np.float32)
    resid = np.repeat(stream, n, axis=2)
    out = np.asarray(expand(jnp.zeros((b, s, d)), jnp.asarray(resid), jnp.zeros((b, s, n)), comb))
    np.testing.assert_allclose(out, resid, rtol=0, atol=1e-5 * np.abs(stream).max())
