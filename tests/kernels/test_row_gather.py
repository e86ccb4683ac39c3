"""``pallas_kernels.row_gather``: rows gathered by index equal ``x[idx]`` exactly (the interpreter here, the
compiled kernel on a GPU), and the MoE's copies through it give the XLA gather's outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import row_gather


def _case(rng, n, m, d, dtype):
    x = jnp.asarray(rng.normal(size=(n, d)), dtype)
    idx = jnp.asarray(rng.integers(0, n, m), jnp.int32)  # rows repeat, as a token's k copies do
    return x, idx


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 256), (jnp.float32, 384)])
def test_gathered_rows_equal_indexing(dtype, d):
    x, idx = _case(np.random.default_rng(0), 50, 48, d, dtype)
    out = row_gather.gather_rows(x, idx, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[np.asarray(idx)])


def test_shapes_it_does_not_take_are_refused():
    x, idx = _case(np.random.default_rng(0), 50, 40, 256, jnp.float32)  # 40 rows: not a multiple of ROWS
    assert not row_gather.applies(x, idx)
    with pytest.raises(ValueError, match="40 rows of width 256"):
        row_gather.gather_rows(x, idx, interpret=True)


@pytest.mark.gpu
def test_compiled_gather_and_the_moe_copies_on_gpu(monkeypatch):
    from flax import nnx

    from dsv41_jax.model import moe

    rng = np.random.default_rng(1)
    x, idx = _case(rng, 4096, 8192, 1024, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(row_gather.gather_rows(x, idx)), np.asarray(x)[np.asarray(idx)])

    t, k, dim, inter, e = 2048, 4, 256, 128, 8
    xs = jnp.asarray(rng.normal(size=(t, dim)), jnp.bfloat16)
    picks = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(t, dim)), jnp.float32)
    graphdef, state = nnx.split(moe.Experts(e, dim, inter, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

    def loss(st, xs, w):
        out = moe.routed_experts(xs, picks, w, nnx.merge(graphdef, st), 10.0, implementation="xla", path="grouped")
        return jnp.sum(out * cot)

    def run():
        return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(state, xs, w))

    monkeypatch.setattr(moe, "ROW_GATHER_KERNEL", False)
    want = run()
    monkeypatch.setattr(moe, "ROW_GATHER_KERNEL", True)
    got = run()
    for a, b in zip(got, want, strict=True):  # the same rows in the same order: the same sums, bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
