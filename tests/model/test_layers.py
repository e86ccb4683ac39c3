"""The model's mixed-precision product (``layers.mixed_einsum``) and the Linear built on it."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from dsv41_jax.model.layers import Linear, fp32_head, mixed_einsum
from dsv41_jax.model.transformer import REMAT
from dsv41_jax.testing import mixed_products

SPEC = "bqx,yx->bqy"


def _case(rng, dtype):
    a = jnp.asarray(rng.normal(size=(2, 8, 32)), dtype)
    b = jnp.asarray(rng.normal(size=(24, 32)) * 32 ** -0.5, dtype)
    g = jnp.asarray(rng.normal(size=(2, 8, 24)), jnp.float32)  # an fp32 cotangent, as after a softmax
    return a, b, g


def test_fp32_operands_are_autodiff_of_the_plain_product(rng):
    a, b, g = _case(rng, jnp.float32)
    plain = lambda a, b: jnp.sum(jnp.einsum(SPEC, a, b, preferred_element_type=jnp.float32) * g)  # noqa: E731
    mixed = lambda a, b: jnp.sum(mixed_einsum(SPEC, a, b) * g)  # noqa: E731
    got, want = (jax.jit(jax.value_and_grad(f, (0, 1)))(a, b) for f in (mixed, plain))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)


def test_bf16_backward_is_bf16_products_of_the_rounded_cotangent(rng):
    """fp32 output; each gradient is the float64 product of the cotangent rounded to bf16, rounded once to bf16;
    no product of the backward mixes fp32 with bf16 (autodiff's would: an fp32 GEMM on GPU)."""
    a, b, g = _case(rng, jnp.bfloat16)
    out = mixed_einsum(SPEC, a, b)
    assert out.dtype == jnp.float32
    want = np.einsum(SPEC, np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    loss = lambda a, b: jnp.sum(mixed_einsum(SPEC, a, b) * g)  # noqa: E731
    da, db = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    assert da.dtype == db.dtype == jnp.bfloat16
    g16 = np.asarray(g.astype(jnp.bfloat16), np.float64)
    for got, want in ((da, np.einsum("bqy,yx->bqx", g16, np.asarray(b, np.float64))),
                      (db, np.einsum("bqy,bqx->yx", g16, np.asarray(a, np.float64)))):
        want = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -7, atol=1e-6)
    assert mixed_products(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b).jaxpr) == []
    autodiff = lambda a, b: jnp.sum(jnp.einsum(SPEC, a, b, preferred_element_type=jnp.float32) * g)  # noqa: E731
    assert mixed_products(jax.make_jaxpr(jax.grad(autodiff, (0, 1)))(a, b).jaxpr)  # what it replaces


def test_bf16_linear_gradients_are_autodiff_s(rng):
    """In a Linear the cotangent arrives from the bf16 cast of the product, so rounding it to bf16 is exact:
    the gradients are those of autodiff of the fp32-accumulated product (to the products' summation order)."""
    graphdef, state = nnx.split(Linear(32, 24, "mlp_up", dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                       rngs=nnx.Rngs(0)))
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(2, 8, 24)), jnp.float32)
    w = state["weight"][...]

    def autodiff(x, w):
        y = jnp.einsum("...x,yx->...y", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return jnp.sum(y.astype(jnp.bfloat16).astype(jnp.float32) * g)

    def ours(x, w):
        return jnp.sum(nnx.merge(graphdef, nnx.State({"weight": nnx.Param(w)}))(x).astype(jnp.float32) * g)

    for got, want in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(autodiff, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)


def test_remat_dots_keeps_the_products(rng):
    """``remat: dots`` saves mixed_einsum's outputs (a custom rule, which ``dots_saveable`` alone does not see);
    ``block`` saves only the inputs."""
    a, b, _ = _case(rng, jnp.bfloat16)
    f = lambda a, b: jnp.tanh(mixed_einsum(SPEC, a, b)).sum()  # noqa: E731
    shapes = {k: [r[0].shape for r in saved_residuals(jax.checkpoint(f, policy=REMAT[k]), a, b)]
              for k in ("block", "dots")}
    assert (2, 8, 24) in shapes["dots"] and (2, 8, 24) not in shapes["block"]


def test_fp32_head_split_into_bf16_terms_is_the_fp32_product(rng):
    """The head's product with a bf16 weight as three bf16 terms of x (GPU's form): within fp32 rounding of
    the exact product, like the fp32 product itself; one bf16 term alone (a bf16 head) is 1000× further off."""
    d, v = 512, 96
    x = (rng.standard_normal((2, 3, d)) * np.exp(rng.uniform(-4, 4, (2, 3, 1)))).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((v, d)) * d ** -0.5, jnp.bfloat16)
    exact = np.einsum("bsd,vd->bsv", x.astype(np.float64), np.asarray(w, np.float64))

    def rel(y):
        return (np.linalg.norm(np.asarray(y, np.float64) - exact, axis=-1) / np.linalg.norm(exact, axis=-1)).max()

    split = jax.jit(lambda x, w: fp32_head(x, w, split=True))(jnp.asarray(x), w)
    plain = jax.jit(lambda x, w: fp32_head(x, w, split=False))(jnp.asarray(x), w)
    one_term = jnp.einsum("bsd,vd->bsv", jnp.asarray(x).astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    assert split.dtype == jnp.float32 and split.shape == (2, 3, v)
    assert rel(split) < 1e-6 and rel(plain) < 1e-6, (rel(split), rel(plain))
    assert rel(one_term) > 1e-3
    # the split form's gradients are the fp32 product's
    g = jnp.asarray(rng.standard_normal((2, 3, v)), jnp.float32)
    grads = [jax.grad(lambda x, w, s=s: (fp32_head(x, w, split=s) * g).sum(), argnums=(0, 1))(jnp.asarray(x), w)
             for s in (True, False)]
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # an fp32 weight takes the plain product whatever the backend
    w32 = jnp.asarray(w, jnp.float32)
    np.testing.assert_array_equal(np.asarray(fp32_head(jnp.asarray(x), w32, split=True)),
                                  np.asarray(fp32_head(jnp.asarray(x), w32, split=False)))
