"""Sparse attention with sink (spec attention §3.6, §5, §9.2).

Three implementations are compared: the chunked ``sparse_attention``, the dense-mask ``dense_attention``
(the library's own oracle) and a naive float64 loop that builds each query's key list explicitly —
window keys max(replay_start, i−W+1) … i, then the selected compressed entries — and runs one softmax
whose denominator also holds e^{sink_h}.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.sparse import dense_attention, sparse_attention

N, H = 3, 16


# replay_start is traced (both implementations only compare positions with it), so one compilation
# per shape serves every replay start
@functools.partial(jax.jit, static_argnames=("window",))
def _sparse(q, kv, sink, window, ckv, topk, replay_start):
    return sparse_attention(q, kv, sink, window, ckv, topk, replay_start)


@functools.partial(jax.jit, static_argnames=("window",))
def _dense(q, kv, sink, window, ckv, topk, replay_start):
    return dense_attention(q, kv, sink, window, ckv, topk, replay_start)


def sparse(q, kv, sink, window, ckv=None, topk=None, replay_start=0):
    return _sparse(q, kv, sink, window, ckv, topk, jnp.int32(replay_start))


def dense(q, kv, sink, window, ckv=None, topk=None, replay_start=0):
    return _dense(q, kv, sink, window, ckv, topk, jnp.int32(replay_start))


def naive_oracle(q, kv, sink, window, ckv=None, topk=None, replay_start=0, use_sink=True):
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    b, s, n, h = q.shape
    out = np.zeros((b, s, n, h))
    for bi in range(b):
        for i in range(s):
            keys = [kv[bi, j] for j in range(max(replay_start, i - window + 1), i + 1)]
            if ckv is not None:
                keys += [np.asarray(ckv[bi, t], np.float64) for t in topk[bi, i] if t >= 0]
            if not keys:
                continue  # only the sink: numerator 0
            keys = np.stack(keys)
            for hh in range(n):
                logits = keys @ q[bi, i, hh] / np.sqrt(h)
                top = max(logits.max(), float(sink[hh])) if use_sink else logits.max()
                p = np.exp(logits - top)
                den = p.sum() + (np.exp(float(sink[hh]) - top) if use_sink else 0.0)
                out[bi, i, hh] = p @ keys / den
    return out


def make_inputs(rng, b, s, t=None, k=None, frac_empty=0.3, q_scale=2.0):
    q = (rng.standard_normal((b, s, N, H)) * q_scale).astype(np.float32)
    kv = rng.standard_normal((b, s, H)).astype(np.float32)
    sink = rng.normal(0, 1.5, N).astype(np.float32)
    if t is None:
        return q, kv, sink, None, None
    ckv = rng.standard_normal((b, t, H)).astype(np.float32)
    # each row: k distinct entries in random order (a real top-k never repeats one), some −1
    topk = np.stack([np.stack([rng.permutation(t)[:k] for _ in range(s)]) for _ in range(b)])
    topk = np.where(rng.random((b, s, k)) < frac_empty, -1, topk).astype(np.int32)
    topk[0, 0] = -1  # one row with no compressed pick at all
    return q, kv, sink, ckv, topk


def as_jax(*xs):
    return [None if x is None else jnp.asarray(x) for x in xs]


def check_all_three(q, kv, sink, window, ckv=None, topk=None, replay_start=0):
    got = np.asarray(sparse(*as_jax(q, kv, sink), window, *as_jax(ckv, topk), replay_start=replay_start))
    ref = np.asarray(dense(*as_jax(q, kv, sink), window, *as_jax(ckv, topk), replay_start=replay_start))
    want = naive_oracle(q, kv, sink, window, ckv, topk, replay_start)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    return got


@pytest.mark.parametrize("s,window", [(27, 8), (5, 8), (33, 4)])
def test_sparse_equals_dense_and_naive_with_compressed(rng, s, window):
    q, kv, sink, ckv, topk = make_inputs(rng, 2, s, t=13, k=6)
    check_all_three(q, kv, sink, window, ckv, topk)


def test_sparse_equals_dense_and_naive_window_only(rng):
    q, kv, sink, _, _ = make_inputs(rng, 2, 27)  # 27 = 3 full windows of 8 + 3
    check_all_three(q, kv, sink, 8)


@pytest.mark.parametrize("replay_start", [1, 5, 13, 20])
def test_bounded_replay_truncates_window(rng, replay_start):
    q, kv, sink, ckv, topk = make_inputs(rng, 2, 27, t=13, k=6)
    got = check_all_three(q, kv, sink, 8, ckv, topk, replay_start=replay_start)
    # keys before replay_start are invisible: changing them leaves every output unchanged
    kv2 = kv.copy()
    kv2[:, :replay_start] = rng.standard_normal((2, replay_start, H)) * 10
    got2 = np.asarray(sparse(*as_jax(q, kv2, sink), 8, *as_jax(ckv, topk), replay_start=replay_start))
    np.testing.assert_array_equal(got2[:, replay_start:], got[:, replay_start:])


def test_bounded_replay_window_only(rng):
    q, kv, sink, _, _ = make_inputs(rng, 2, 27)
    check_all_three(q, kv, sink, 8, replay_start=9)


def test_window_excludes_old_and_future_keys(rng):
    s, w = 27, 8
    q, kv, sink, _, _ = make_inputs(rng, 2, s)
    base = np.asarray(sparse(*as_jax(q, kv, sink), w))
    i = 12  # sees keys 5..12 only
    for j, visible in [(4, False), (5, True), (12, True), (13, False)]:
        kv2 = kv.copy()
        kv2[0, j] += 5.0
        out = np.asarray(sparse(*as_jax(q, kv2, sink), w))
        assert (np.abs(out[0, i] - base[0, i]).max() > 0) == visible, j


def test_sink_minus_large_is_plain_softmax(rng):
    q, kv, _, ckv, topk = make_inputs(rng, 2, 27, t=13, k=6)
    sink = np.full(N, -1e30, np.float32)
    plain = naive_oracle(q, kv, sink, 8, ckv, topk, use_sink=False)
    for fn in (sparse, dense):
        got = np.asarray(fn(*as_jax(q, kv, sink), 8, *as_jax(ckv, topk)))
        np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)


def test_sink_large_drives_output_to_zero(rng):
    q, kv, _, ckv, topk = make_inputs(rng, 2, 27, t=13, k=6)
    sink = np.array([60.0, 200.0, 1e4], np.float32)
    for fn in (sparse, dense):
        got = np.asarray(fn(*as_jax(q, kv, sink), 8, *as_jax(ckv, topk)))
        assert np.isfinite(got).all()
        # sink 60: every weight is ≈ e^-60; entries are sums of mixed-sign terms, so the error budget
        # is relative to the head's largest output, not to each (possibly cancelling) entry
        want = naive_oracle(q, kv, sink, 8, ckv, topk)[:, :, 0]
        np.testing.assert_allclose(got[:, :, 0], want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        assert np.abs(got[:, :, 0]).max() < 1e-20
        # sinks 200 and 1e4: e^{z − sink} underflows in fp32, the output is exactly zero
        assert (got[:, :, 1:] == 0).all()


def test_sink_is_only_in_the_denominator(rng):
    """With one visible key (query 0, no picks) the output is v·e^z/(e^z + e^sink): the sink has a zero
    value vector and is not multiplied by the softmax scale."""
    q, kv, sink, _, _ = make_inputs(rng, 1, 1)
    got = np.asarray(sparse(*as_jax(q, kv, sink), 8))[0, 0]
    z = q[0, 0].astype(np.float64) @ kv[0, 0] / np.sqrt(H)
    want = kv[0, 0][None] * (1 / (1 + np.exp(sink.astype(np.float64) - z)))[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _loss(fn, q, kv, sink, ckv, topk, cot, replay_start):
    return (fn(q, kv, sink, 8, ckv, topk, replay_start) * cot).sum()


_grads = {name: jax.jit(jax.grad(functools.partial(_loss, fn), argnums=(0, 1, 2, 3)))
          for name, fn in (("sparse", sparse_attention), ("dense", dense_attention))}


def test_gradients_sparse_equal_dense(rng):
    q, kv, sink, ckv, topk = make_inputs(rng, 2, 27, t=13, k=6)
    cot = rng.standard_normal(q.shape).astype(np.float32)
    for replay_start in (0, 6):
        args = (*as_jax(q, kv, sink, ckv, topk, cot), jnp.int32(replay_start))
        gs, gd = _grads["sparse"](*args), _grads["dense"](*args)
        for name, a, b in zip(("q", "window_kv", "sink", "compressed_kv"), gs, gd, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert np.isfinite(a).all(), name
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=name)
        # compressed entries that no query of batch 0 picked get no gradient
        unpicked = np.setdiff1d(np.arange(13), topk[0][topk[0] >= 0])
        assert (np.asarray(gs[3])[0, unpicked] == 0).all()
        # with replay, window keys before the start are invisible to every query: zero gradient
        if replay_start:
            assert (np.asarray(gs[1])[:, :replay_start] == 0).all()


def test_gather_entries_gradient_sums_in_fp32():
    """The picked entries' gradient: the same sum as autodiff of a plain gather (fp32), and in bf16 it is
    the exact sum rounded once, where autodiff's bf16 scatter-add rounds at every collision."""
    from dsv41_jax.model.sparse import gather_entries

    rng = np.random.default_rng(0)
    b, t, h, s, k = 2, 16, 8, 64, 12
    kv = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, t, (b, s, k)), jnp.int32)  # each entry picked ~48 times
    w = jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32)

    def loss(gather, kv):
        return jnp.sum(gather(kv, idx).astype(jnp.float32) * w)

    plain = lambda kv_, i: jax.vmap(lambda a, j: a[j])(kv_, i)  # noqa: E731
    got = jax.grad(lambda x: loss(gather_entries, x))(kv)
    want = jax.grad(lambda x: loss(plain, x))(kv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)

    exact = np.zeros((b, t, h))
    np.add.at(exact, (np.arange(b)[:, None, None], np.asarray(idx)), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5)
    kb, wb = kv.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    exact_b = np.zeros((b, t, h))
    np.add.at(exact_b, (np.arange(b)[:, None, None], np.asarray(idx)), np.asarray(wb.astype(jnp.float32), np.float64))
    lb = lambda g, x: jnp.sum(g(x, idx).astype(jnp.float32) * wb.astype(jnp.float32))  # noqa: E731
    got_b = np.asarray(jax.grad(lambda x: lb(gather_entries, x))(kb).astype(jnp.float32), np.float64)
    want_b = np.asarray(jax.grad(lambda x: lb(plain, x))(kb).astype(jnp.float32), np.float64)
    once = np.asarray(jnp.asarray(exact_b, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got_b, once)  # rounded once from the exact sum
    assert np.abs(want_b - exact_b).max() > np.abs(got_b - exact_b).max()
