"""MoE router, clamped-SwiGLU experts and the shared expert (spec model §5.1–§5.2).

Oracles: float64 numpy per token — sqrtsoftplus scores, an explicit sort for the biased top-k, and a
python loop over each token's selected experts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model.moe import MoE, routed_experts
from dsv41_jax.testing import mixed_products

DIM = 64


def make_moe(tiny_cfg, seed=0, n_experts=8, k=2):
    moe = MoE(tiny_cfg.moe, DIM, n_experts, k, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    # zero biases at init would hide a swapped bias / bias_vl or a bias leaking into the weights
    moe.gate.bias[...] = jnp.asarray(rng.normal(0, 0.3, n_experts), jnp.float32)
    moe.gate.bias_vl[...] = jnp.asarray(rng.normal(0, 0.3, n_experts), jnp.float32)
    return moe


def to_np(v):
    return np.asarray(v[...], np.float64)


def scores_oracle(x, w):
    z = np.asarray(x, np.float64) @ w.T
    return np.sqrt(np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0))  # sqrt(softplus(z))


def route_oracle(x, w, bias, bias_vl, is_image, k, route_scale):
    """Per token: top-k of s + b (b = bias_vl on image tokens), weights from the unbiased s."""
    s = scores_oracle(x, w)  # [B, S, E]
    b_, s_, e_ = s.shape
    experts = np.zeros((b_, s_, k), np.int64)
    weights = np.zeros((b_, s_, k))
    for bi in range(b_):
        for si in range(s_):
            bias_t = bias_vl if (is_image is not None and is_image[bi, si]) else bias
            biased = s[bi, si] + bias_t
            order = sorted(range(e_), key=lambda e: (-biased[e], e))[:k]
            experts[bi, si] = order
            chosen = s[bi, si, order]
            weights[bi, si] = chosen / (chosen.sum() + 1e-20) * route_scale
    return experts, weights, s


def silu(v):
    return v / (1.0 + np.exp(-v))


def swiglu_oracle(x, w1, w3, w2, limit, route_w=1.0):
    g = w1 @ x
    u = w3 @ x
    u = np.clip(u, -limit, limit)  # up branch: both sides
    g = np.minimum(g, limit)  # gate branch: from above only
    return w2 @ (silu(g) * u * route_w)


def routed_oracle(x, experts, weights, w1, w3, w2, limit):
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for kk in range(experts.shape[1]):
            e = experts[t, kk]
            out[t] += swiglu_oracle(x[t].astype(np.float64), w1[e], w3[e], w2[e], limit, weights[t, kk])
    return out


# --------------------------------------------------------------------------------------------------
# router


def test_router_matches_oracle_and_sums_to_route_scale(tiny_cfg, rng):
    moe = make_moe(tiny_cfg)
    x = rng.normal(0, 2.0, (3, 11, DIM)).astype(np.float32)
    is_image = rng.random((3, 11)) < 0.4
    r = moe.gate(jnp.asarray(x), jnp.asarray(is_image))
    experts, weights, scores = (np.asarray(v) for v in r)
    we, ww, ws = route_oracle(x, to_np(moe.gate.weight), to_np(moe.gate.bias), to_np(moe.gate.bias_vl),
                              is_image, 2, tiny_cfg.moe.route_scale)
    np.testing.assert_allclose(scores, ws, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(experts, we)
    np.testing.assert_allclose(weights, ww, rtol=1e-5, atol=1e-7)
    assert tiny_cfg.moe.route_scale == 1.5
    np.testing.assert_allclose(weights.sum(-1), 1.5, rtol=1e-6, atol=0)


def test_router_bias_flips_selection_but_not_weights(tiny_cfg, rng):
    moe = make_moe(tiny_cfg)
    x = rng.normal(0, 1.0, (1, 6, DIM)).astype(np.float32)
    s = scores_oracle(x, to_np(moe.gate.weight))[0]  # [S, E]
    # push the expert with the lowest mean score above everything: selection must change
    low = int(np.argmin(s.mean(0)))
    bias = np.zeros(8, np.float32)
    bias[low] = 50.0
    moe.gate.bias[...] = jnp.asarray(bias)
    experts, weights, _ = (np.asarray(v) for v in moe.gate(jnp.asarray(x), None))
    unbiased_top2 = np.argsort(-s, axis=-1, kind="stable")[:, :2]
    assert (unbiased_top2 != low).all()  # without the bias it is never picked ...
    assert (experts[0, :, 0] == low).all()  # ... with it, it always comes first
    other = experts[0, :, 1]
    np.testing.assert_array_equal(other, unbiased_top2[:, 0])
    t = np.arange(6)
    want = np.stack([s[t, low], s[t, other]], -1)
    want = want / want.sum(-1, keepdims=True) * 1.5  # unbiased scores, not s + 50
    np.testing.assert_allclose(weights[0], want, rtol=1e-5, atol=1e-7)
    assert weights[0, :, 0].max() < 1.5 * 0.99  # a biased weight would be ≈ 1.5·50/(50+s)


def test_bias_vl_exactly_at_image_positions(tiny_cfg, rng):
    moe = make_moe(tiny_cfg)
    bias, bias_vl = np.zeros(8, np.float32), np.zeros(8, np.float32)
    bias[5], bias_vl[3] = 100.0, 100.0
    moe.gate.bias[...] = jnp.asarray(bias)
    moe.gate.bias_vl[...] = jnp.asarray(bias_vl)
    x = rng.normal(0, 1.0, (2, 13, DIM)).astype(np.float32)
    is_image = rng.random((2, 13)) < 0.5
    is_image[0, 0], is_image[0, 1] = True, False
    experts = np.asarray(moe.gate(jnp.asarray(x), jnp.asarray(is_image)).experts)
    np.testing.assert_array_equal(experts[..., 0], np.where(is_image, 3, 5))
    # no image mask means every token is text
    text = np.asarray(moe.gate(jnp.asarray(x), None).experts)
    np.testing.assert_array_equal(text[..., 0], 5)
    np.testing.assert_array_equal(text, np.asarray(moe.gate(jnp.asarray(x), jnp.zeros((2, 13), bool)).experts))


# --------------------------------------------------------------------------------------------------
# experts


def test_routed_experts_equal_per_token_loop(tiny_cfg, rng):
    moe = make_moe(tiny_cfg)
    t, k, n = 37, 2, 8
    x = rng.normal(0, 8.0, (t, DIM)).astype(np.float32)  # large enough for the clamp to bind
    experts = np.stack([rng.choice(n - 1, size=k, replace=False) for _ in range(t)])  # expert 7 gets no token
    weights = rng.uniform(0.1, 1.4, (t, k)).astype(np.float32)
    w1, w3, w2 = (to_np(m.weight) for m in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
    limit = tiny_cfg.moe.swiglu_limit
    assert limit == 10.0

    g = np.einsum("eid,td->tei", w1, x)[np.arange(t)[:, None], experts]
    u = np.einsum("eid,td->tei", w3, x)[np.arange(t)[:, None], experts]
    assert (u > limit).any() and (u < -limit).any(), "up clamp must bind on both sides"
    assert (g > limit).any() and (g < -limit).any(), "gate must exceed the limit on both sides"

    fun = nnx.jit(lambda m, x, e, w: routed_experts(x, e, w, m, limit))
    got = np.asarray(fun(moe.experts, jnp.asarray(x), jnp.asarray(experts, jnp.int32), jnp.asarray(weights)))
    want = routed_oracle(x, experts, weights.astype(np.float64), w1, w3, w2, limit)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    # the tolerance above separates the clamp conventions: clamping the gate from below as well changes
    # silu(g) only for g < −10 (|silu(−10)| ≈ 4.5e-4), small but still outside it; no up clamp is far off
    def variant(gate_lo, up_lim):
        out = np.zeros_like(want)
        for tt in range(t):
            for kk in range(k):
                e = experts[tt, kk]
                gg = np.clip(w1[e] @ x[tt], gate_lo, limit)
                uu = np.clip(w3[e] @ x[tt], -up_lim, up_lim)
                out[tt] += w2[e] @ (silu(gg) * uu * weights[tt, kk])
        return out
    atol = 1e-5 * np.abs(want).max()
    assert not np.allclose(variant(-limit, limit), want, rtol=1e-5, atol=atol)
    assert not np.allclose(variant(-np.inf, np.inf), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_moe_equals_routed_plus_shared(tiny_cfg, rng):
    moe = make_moe(tiny_cfg, seed=3)
    x = rng.normal(0, 6.0, (2, 9, DIM)).astype(np.float32)
    is_image = rng.random((2, 9)) < 0.3
    fun = nnx.jit(lambda m, x, im: m(x, im))
    y, routing = fun(moe, jnp.asarray(x), jnp.asarray(is_image))
    y = np.asarray(y)

    limit = tiny_cfg.moe.swiglu_limit
    we, ww, _ = route_oracle(x, to_np(moe.gate.weight), to_np(moe.gate.bias), to_np(moe.gate.bias_vl), is_image, 2,
                             1.5)
    np.testing.assert_array_equal(np.asarray(routing.experts), we)
    flat = x.reshape(-1, DIM)
    w1, w3, w2 = (to_np(m.weight) for m in (moe.experts.w1, moe.experts.w3, moe.experts.w2))
    routed = routed_oracle(flat, we.reshape(-1, 2), ww.reshape(-1, 2), w1, w3, w2, limit)
    sh = moe.shared_experts
    shared = np.stack([swiglu_oracle(v.astype(np.float64), to_np(sh.w1.weight), to_np(sh.w3.weight),
                                     to_np(sh.w2.weight), limit) for v in flat])
    want = (routed + shared).reshape(2, 9, DIM)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the shared expert's clamp binds too on this input
    assert np.abs(flat.astype(np.float64) @ to_np(sh.w3.weight).T).max() > limit


# picks with a duplicate inside a row (3, 3), experts shared across rows, and experts 1, 2, 4 and 6 of 8 never
# picked (empty groups on the grouped path)
PICKS = [[3, 3, 5], [5, 0, 7], [7, 3, 0], [0, 5, 3]]


@pytest.mark.parametrize("native, dtype", [(False, jnp.float32), (True, jnp.bfloat16)],
                         ids=["float-fp32", "mxfp4-bf16"])
def test_gathered_and_dense_experts_equal_the_grouped_matmul(native, dtype):
    """The forced ``gather`` path (both forms: copies taken then multiplied, and the fused products summed by
    reductions that the GPU takes) and the ``dense`` path equal the forced ``grouped`` one (which equals the
    per-token loop above): float storage in fp32, and the release's storage (MXFP4 experts, bf16
    activations). All take operands in the activation dtype with fp32 sums and round the activation to it
    before ``w2``, so only the fp32 summation order differs: bound 1e-5 of the largest output entry
    (measured: at most 3.1e-7 of it in fp32, 7e-8 in bf16; float storage in bf16 and MXFP4 in fp32 measured
    alike, 1.6e-7 and 1.8e-7). ``dense`` sums a row's duplicate pick (3, 3) as one expert with the summed
    weight, which rounds the activation once instead of twice: held to the bf16 rounding of that term,
    2^-8 of the output, in bf16 (a ``top_k`` never picks an expert twice)."""
    from dsv41_jax.model.moe import Experts, _gathered_experts

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(0, 4.0, (len(PICKS), DIM)), dtype)
    weights = jnp.asarray(rng.uniform(0.1, 1.4, (len(PICKS), 3)), jnp.float32)
    ex = Experts(8, DIM, 32, param_dtype=dtype, rngs=nnx.Rngs(2), native=native)
    picks = jnp.asarray(PICKS, jnp.int32)
    fun = nnx.jit(lambda m, x, e, w, path: routed_experts(x, e, w, m, 10.0, path=path), static_argnums=4)
    want = np.asarray(fun(ex, x, picks, weights, "grouped"))
    fused = nnx.jit(lambda m, x, e, w: _gathered_experts(
        x, e, w, tuple(v.stored() for v in (m.w1, m.w2, m.w3)), 10.0, fused=True))
    scale = np.abs(want).max()
    assert scale > 1
    for name, got in (("gather", fun(ex, x, picks, weights, "gather")), ("fused", fused(ex, x, picks, weights)),
                      ("dense", fun(ex, x, picks, weights, "dense"))):
        bound = 2.0 ** -8 if name == "dense" and dtype == jnp.bfloat16 else 1e-5
        assert np.abs(np.asarray(got) - want).max() <= bound * scale, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_grouped_path_gradients_equal_the_dense_path_without_scatter_add(dtype):
    """The grouped path's gradients (token rows, routing weights, all three expert matrices) equal the dense
    path's, which multiplies against every expert and has no sort, copy or permutation; the grouped path moves
    token copies by permutations, so neither its forward nor its backward holds a scatter-add (indexing would
    transpose into one: atomics on GPU, a rounding per addition in bf16). fp32: 1e-5 of each gradient's largest
    entry (summation order only); bf16: both paths round the activation and the cotangents to bf16 at the same
    points, in bf16 results: bound 2^-6 of the largest entry (measured up to 7e-3; fp32 up to 3.3e-7)."""
    from dsv41_jax.model.moe import Experts

    rng = np.random.default_rng(11)
    t, k = 29, 3
    x = jnp.asarray(rng.normal(0, 2.0, (t, DIM)), dtype)
    picks = jnp.asarray(np.stack([rng.choice(7, size=k, replace=False) for _ in range(t)]), jnp.int32)  # 7: none
    weights = jnp.asarray(rng.uniform(0.1, 1.4, (t, k)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(t, DIM)), jnp.float32)
    graphdef, state = nnx.split(Experts(8, DIM, 32, param_dtype=dtype, rngs=nnx.Rngs(3)))

    def loss(st, x, w, path):
        return jnp.sum(routed_experts(x, picks, w, nnx.merge(graphdef, st), 10.0, path=path) * cot)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got, want = (jax.jit(grad, static_argnums=3)(state, x, weights, p) for p in ("grouped", "dense"))
    bound = 1e-5 if dtype == jnp.float32 else 2.0 ** -6
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.abs(w).max() > 0 and np.abs(g - w).max() <= bound * np.abs(w).max()
    lines = str(jax.make_jaxpr(grad, static_argnums=3)(state, x, weights, "grouped")).splitlines()
    adds = [ln for ln in lines if "scatter-add[" in ln]
    assert adds and all(":i32[" in ln for ln in adds), adds  # the only one: bincount's group sizes


def _weight_reads(fun, stored, *args):
    """``(primitive or jitted function, output shape, bytes)`` of each equation of ``fun``'s jaxpr that takes
    one of the ``stored`` arrays (its first arguments)."""
    jaxpr = jax.make_jaxpr(fun)(stored, *args).jaxpr
    ins = {id(v) for v in jaxpr.invars[:len(jax.tree.leaves(stored))]}
    return [(e.params.get("name", e.primitive.name), e.outvars[0].aval.shape,
             e.outvars[0].aval.size * e.outvars[0].aval.dtype.itemsize)
            for e in jaxpr.eqns if any(id(v) in ins for v in e.invars)]


@pytest.mark.parametrize("native", [False, True], ids=["float", "mxfp4"])
def test_gathered_path_reads_only_the_picked_experts(native):
    """The weights enter the gathered path's program only through gathers of the U·K picked experts, so the
    bytes it reads (``U·K × bytes per expert``) are the same for 16 and 256 experts; the grouped path's
    first use of the weights is all E experts. (XLA's ``cost_analysis`` charges a gather its whole operand,
    so its byte count cannot show this; the jaxpr can.)"""
    from dsv41_jax.model.moe import Experts, _read_bytes, routed_path

    # auto picks by bytes moved (routed_path's docstring). Materialised copies (CPU, TPU): weights in the
    # activation dtype, 3·copies < E; MXFP4 under bf16, copies < 0.81·E (the release's 384 experts up to batch
    # 51); else grouped. Fused copies (GPU): copies < E in the activation dtype, copies < ~8.5·E for MXFP4;
    # else dense up to 128 tokens, grouped beyond. Forced paths; a misspelt one
    mx = _read_bytes(Experts(2, DIM, 32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), native=True).w1, jnp.bfloat16)
    assert mx == {"stored": 0.5 + 1 / 32, "dequantised": 4}
    cpu = functools.partial(routed_path, backend="cpu")
    assert cpu(5, 5, 16) == "gather" and cpu(6, 6, 16) == "grouped"
    assert cpu(6 * 51, 51, 384, **mx) == "gather" and cpu(6 * 52, 52, 384, **mx) == "grouped"
    gpu = functools.partial(routed_path, backend="gpu")
    assert gpu(6, 1, 16) == "gather" and gpu(18, 3, 16) == "dense" and gpu(6 * 129, 129, 16) == "grouped"
    assert gpu(6 * 540, 540, 384, **mx) == "gather" and gpu(6 * 560, 560, 384, **mx) == "grouped"
    assert routed_path(100, 100, 8, "gather") == "gather" and routed_path(1, 1, 384, "grouped") == "grouped"
    assert routed_path(1, 1, 384, "dense") == "dense"
    with pytest.raises(ValueError, match="got 'sparse'"):
        routed_path(1, 1, 8, "sparse")
    x, picks, w = jnp.ones((2, DIM)), jnp.asarray([[1, 5, 9], [5, 2, 0]], jnp.int32), jnp.ones((2, 3))
    for n in (16, 256):
        graphdef, state = nnx.split(Experts(n, DIM, 32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), native=native))
        per_expert = sum(a.nbytes for a in jax.tree.leaves(state)) // n
        for path in ("gather", "grouped"):
            reads = _weight_reads(lambda st, x, e, w, path=path, g=graphdef: routed_experts(
                x, e, w, nnx.merge(g, st), 10.0, path=path), state, x, picks, w)
            if path == "gather":  # one take per stored array: codes (and scales) of w1, w2, w3
                assert [r[0] for r in reads] == ["_take"] * 3 * (2 if native else 1), reads
                assert all(r[1][:2] == (2, 3) for r in reads), reads
                assert sum(r[2] for r in reads) == 6 * per_expert
            else:  # w1, w2, w3 dequantised (or cast) whole: w1 and w3 concatenated, w2 transposed
                assert all(r[1][0] == n for r in reads) and sum(r[2] for r in reads) >= n * per_expert, reads


def _grouped_case(rng, dtype, rows=40, tail=5):
    """Rows sorted by group (group 2 empty) and ``tail`` rows past the last group, as under expert parallelism."""
    sizes = np.array([9, 14, 0, rows - tail - 23], np.int32)
    lhs = jnp.asarray(rng.normal(size=(rows, 32)), dtype)
    rhs = jnp.asarray(rng.normal(size=(4, 32, 24)) * 0.2, dtype)
    return lhs, rhs, jnp.asarray(sizes)


def _grouped_oracle(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((lhs.shape[0], rhs.shape[-1])), 0
    for e, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = lhs[start:start + n] @ rhs[e]
        start += n
    return out


def test_grouped_matmul_xla_is_the_grouped_product_with_zero_tail(rng):
    """The CPU path (``auto`` = ``xla`` here) against a per-group loop, with the gradients of both operands;
    an unknown implementation is refused by name."""
    from dsv41_jax.model.moe import grouped_matmul

    lhs, rhs, sizes = _grouped_case(rng, jnp.float32)
    for impl in ("auto", "xla"):
        got = jax.jit(lambda a, b, impl=impl: grouped_matmul(a, b, sizes, impl))(lhs, rhs)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, _grouped_oracle(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
        assert not np.asarray(got[-5:]).any()
    cot = jnp.asarray(rng.normal(size=(40, 24)), jnp.float32)
    da, drhs = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, "xla") * cot), argnums=(0, 1))(lhs, rhs)
    want_da, want_drhs = _grouped_grads_oracle(lhs, rhs, sizes, cot)
    np.testing.assert_allclose(da, want_da, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(drhs, want_drhs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="auto, xla, tokamax or pallas, got 'cublas'"):
        grouped_matmul(lhs, rhs, sizes, "cublas")


def _grouped_grads_oracle(lhs, rhs, sizes, cot):
    a, b, c = (np.asarray(x, np.float64) for x in (lhs, rhs, cot))
    da, db, start = np.zeros_like(a), np.zeros_like(b), 0
    for e, n in enumerate(np.asarray(sizes)):
        da[start:start + n] = c[start:start + n] @ b[e].T
        db[e] = a[start:start + n].T @ c[start:start + n]
        start += n
    return da, db


def test_grouped_matmul_backward_runs_in_bf16(rng):
    """bf16 operands: the fp32 cotangent is rounded to bf16 once and both gradients are bf16 products with fp32
    sums (no fp32 × bf16 product, which promotes to an fp32 GEMM on GPU): each gradient is the float64 product
    of the bf16 cotangent, rounded once to bf16."""
    from dsv41_jax.model.moe import grouped_matmul

    lhs, rhs, sizes = _grouped_case(rng, jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=(40, 24)), jnp.float32)
    loss = lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, "xla") * cot)  # noqa: E731
    da, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    assert da.dtype == drhs.dtype == jnp.bfloat16
    for got, want in zip((da, drhs), _grouped_grads_oracle(lhs, rhs, sizes, cot.astype(jnp.bfloat16)), strict=True):
        want = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -7, atol=1e-6)
    assert mixed_products(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs).jaxpr) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_pallas_equals_xla_forward_and_gradients(rng, dtype):
    """``implementation="pallas"`` (the Pallas interpreter here; Triton on GPU) against lax.ragged_dot: an empty
    group, groups ending mid-tile, rows past the last group zero in the output and the input gradient. fp32: to
    summation order; bf16: both are bf16 products of the bf16 cotangent with fp32 sums, rounded once."""
    from dsv41_jax.model.moe import grouped_matmul

    sizes = jnp.asarray([37, 0, 70, 1, 50], jnp.int32)  # 158 of 176 rows
    lhs = jnp.asarray(rng.normal(size=(176, 64)), dtype)
    rhs = jnp.asarray(rng.normal(size=(5, 64, 48)) * 0.125, dtype)
    cot = jnp.asarray(rng.normal(size=(176, 48)), jnp.float32)

    def run(impl):
        out = grouped_matmul(lhs, rhs, sizes, impl)
        return out, jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, impl) * cot), argnums=(0, 1))(lhs, rhs)

    (y1, (da1, db1)), (y0, (da0, db0)) = run("pallas"), run("xla")
    assert not np.asarray(y1[158:]).any() and not np.asarray(da1[158:], np.float32).any()
    assert da1.dtype == lhs.dtype and db1.dtype == rhs.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    for got, want in ((y1, y0), (da1, da0), (db1, db0)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    with pytest.raises(ValueError, match="experts of 64 x 24; the kernels take multiples of 16"):
        grouped_matmul(lhs, rhs[..., :24], sizes, "pallas")


def test_tokamax_path_takes_its_forward_and_xla_gradients(rng, monkeypatch):
    """``implementation="tokamax"`` runs tokamax's forward and XLA's transpose for the gradients (tokamax's own
    backward was measured wrong on the H200: see ``moe._grouped``). tokamax is stood in for by a
    forward that computes with ``lax.ragged_dot`` and a backward that returns garbage, as the measured one did:
    the forward and both gradients must be the XLA path's, bit for bit."""
    import types

    from dsv41_jax.model import moe

    def standin_ragged_dot(lhs, rhs, sizes, preferred_element_type=None):
        @jax.custom_vjp
        def dot(a, b):
            return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=preferred_element_type)

        dot.defvjp(lambda a, b: (dot(a, b), (a, b)), lambda res, g: (jnp.full_like(res[0], 7), res[1] * 0 + 7))
        return dot(lhs, rhs)

    monkeypatch.setattr(moe, "_tokamax", lambda: types.SimpleNamespace(ragged_dot=standin_ragged_dot))
    lhs, rhs, sizes = _grouped_case(rng, jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=(40, 24)), jnp.float32)

    def run(impl):
        out = moe.grouped_matmul(lhs, rhs, sizes, impl)
        grads = jax.grad(lambda a, b: jnp.sum(moe.grouped_matmul(a, b, sizes, impl) * cot), argnums=(0, 1))
        return out, *grads(lhs, rhs)

    for got, want in zip(jax.jit(lambda: run("tokamax"))(), jax.jit(lambda: run("xla"))(), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("impl,sizes", [
    ("tokamax", [248] * 16),  # tokamax's forward kernel: 16 even groups
    ("pallas", [700, 0, 1, 513, 64, 1500, 300, 900]),  # ``auto`` on GPU: uneven groups, one empty
])
def test_grouped_matmul_kernels_equal_xla_on_gpu(rng, impl, sizes):
    """A kernel implementation against lax.ragged_dot in bf16 at a training-like shape (4,096 rows, some past
    the last group), forward and both gradients; rows past the last group stay zero."""
    from dsv41_jax.model.moe import _tokamax, grouped_matmul

    if impl == "tokamax" and _tokamax() is None:
        pytest.skip("tokamax is not installed (extra gpu)")
    rows, d, f = 4096, 256, 384
    sizes = np.asarray(sizes, np.int32)
    lhs = jnp.asarray(rng.normal(size=(rows, d)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), d, f)) * d ** -0.5, jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=(rows, f)), jnp.float32)

    def run(impl):
        fun = lambda a, b: jnp.sum(grouped_matmul(a, b, jnp.asarray(sizes), impl) * cot)
        out = jax.jit(lambda a, b: grouped_matmul(a, b, jnp.asarray(sizes), impl))(lhs, rhs)
        return out, jax.jit(jax.grad(fun, argnums=(0, 1)))(lhs, rhs)

    (y1, (da1, db1)), (y0, (da0, db0)) = run(impl), run("xla")
    assert not np.asarray(y1[sizes.sum():]).any()
    for got, want in ((y1, y0), (da1, da0), (db1, db0)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # bf16 operands, fp32 sums in either order


@pytest.mark.gpu
def test_auto_takes_the_pallas_kernels_on_gpu_in_bf16_only():
    """``auto`` on the device: the Triton kernels for bf16 operands, XLA's ragged_dot for fp32 ones."""
    from dsv41_jax.model.moe import grouped_matmul

    sizes = jnp.asarray([100, 28], jnp.int32)
    for dtype, kernel in ((jnp.bfloat16, True), (jnp.float32, False)):
        lhs, rhs = jnp.zeros((128, 64), dtype), jnp.zeros((2, 64, 32), dtype)
        text = str(jax.make_jaxpr(lambda a, b: grouped_matmul(a, b, sizes, "auto"))(lhs, rhs))
        assert ("pallas_call" in text) == kernel and ("ragged_dot" in text) != kernel, dtype


@pytest.mark.gpu
def test_gathered_experts_equal_the_grouped_matmul_on_gpu(rng):
    """On the device: MXFP4 experts under bf16 at a decode shape (4 tokens × 6 of 64 experts), the gathered
    path (the fused form there) and the dense one against the grouped matmul (the Pallas kernels), all
    through XLA:GPU's own fusions; bound 2^-7 of the largest output entry, for an activation that rounds to a
    neighbouring bf16 value."""
    from dsv41_jax.model.moe import Experts

    ex = Experts(64, 1024, 512, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3), native=True)
    x = jnp.asarray(rng.normal(0, 1.0, (4, 1024)), jnp.bfloat16)
    picks = jnp.asarray(np.stack([rng.choice(64, 6, replace=False) for _ in range(4)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 0.5, (4, 6)), jnp.float32)
    fun = nnx.jit(lambda m, x, e, w, path: routed_experts(x, e, w, m, 10.0, path=path), static_argnums=4)
    want = np.asarray(fun(ex, x, picks, weights, "grouped"))
    scale = np.abs(want).max()
    assert scale > 0
    for path in ("gather", "dense"):
        got = np.asarray(fun(ex, x, picks, weights, path))
        assert np.abs(got - want).max() <= 2.0 ** -7 * scale, path
