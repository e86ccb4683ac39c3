"""``pallas_kernels.grouped_matmul``: the row-tile schedule covers every group's rows once, and the kernels (the
Pallas interpreter here) equal a float64 per-group loop, forward, input gradient and weight gradient."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm


@pytest.mark.parametrize("sizes", [[37, 0, 70, 1, 50], [0, 0, 176], [64, 64, 48], [0, 0, 0]])
def test_schedule_covers_each_groups_rows_once(sizes):
    rows = 176
    group, first, end = (np.asarray(a) for a in gm.schedule(jnp.asarray(sizes, jnp.int32), rows, bm=16))
    assert len(group) == -(-rows // 16) + len(sizes)
    owner = np.full(rows, -1)
    for g, f, e in zip(group, first, end, strict=True):
        for r in range(f, min(f + 16, e)):  # a tile's rows: its window of 16, up to its group's end
            assert owner[r] == -1, f"row {r} in two tiles"
            owner[r] = g
    want = np.repeat(np.arange(len(sizes)), sizes)
    np.testing.assert_array_equal(owner[:len(want)], want)
    assert (owner[len(want):] == -1).all()


@pytest.mark.parametrize("blocks", [{}, {"bm": 16, "bn": 16, "bk": 16}, {"bm": 32, "bn": 64, "bk": 32}],
                         ids=["defaults", "16", "32x64x32"])
def test_kernels_equal_a_per_group_loop(rng, blocks):
    """At the tuned defaults and at blocks small enough that groups span several tiles and K several steps."""
    sizes = np.array([37, 0, 70, 1, 50])
    lhs = rng.normal(size=(176, 64)).astype(np.float32)
    rhs = rng.normal(size=(5, 64, 48)).astype(np.float32)
    g = rng.normal(size=(176, 48)).astype(np.float32)
    out, dw = np.zeros((176, 48)), np.zeros((5, 64, 48))
    for e, (lo, n) in enumerate(zip(np.cumsum(sizes) - sizes, sizes, strict=True)):
        out[lo:lo + n] = lhs[lo:lo + n].astype(np.float64) @ rhs[e]
        dw[e] = lhs[lo:lo + n].T.astype(np.float64) @ g[lo:lo + n]
    s = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(gm.rows_matmul(jnp.asarray(lhs), jnp.asarray(rhs), s, interpret=True, **blocks), out,
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gm.weights_matmul(jnp.asarray(lhs), jnp.asarray(g), s, interpret=True, **blocks), dw,
                               rtol=1e-5, atol=1e-4)
