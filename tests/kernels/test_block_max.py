"""block_max kernels == the reference block maxima, and api.candidate_block_ids with the pallas backend ==
the XLA path exactly (spec attention §6.1). The XLA path is what ``indexer.candidate_block_ids`` runs by
default; tests/model/test_indexer.py pins it to a per-query loop over the spec.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import indexer
from pallas_kernels import block_max as bm
from pallas_kernels.block_max import reference, tpu

IMPLS = {
    "tpu_interpret": functools.partial(tpu.block_max, blocks_per_step=8, interpret=True),
}


def _scores(rng, b: int, s: int, t: int, *, ties: bool, dtype=jnp.float32):
    """Causally masked scores (−∞ at t >= n_p) with per-row n_p including 0 (fully masked) and T."""
    x = rng.standard_normal((b, s, t))
    if ties:  # few distinct values: block maxima tie across blocks, and exact zeros (all-ReLU-zero heads)
        x = np.maximum(np.round(x * 2), 0.0)
    n = rng.integers(0, t + 1, (b, s))
    n.flat[0], n.flat[-1] = 0, t
    x = np.where(np.arange(t) < n[..., None], x, -np.inf)
    return jnp.asarray(x, dtype), jnp.asarray(n, jnp.int32)


SHAPES = [(1, 1, 8, 8), (2, 3, 37, 8), (3, 2, 129, 8), (2, 5, 100, 4), (1, 3, 70, 16), (2, 2, 5, 8)]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("ties", [False, True])
def test_block_max_matches_reference(impl, ties):
    rng = np.random.default_rng(int(ties))
    for b, s, t, bs in SHAPES:
        for dtype in (jnp.float32, jnp.bfloat16) if ties else (jnp.float32,):  # bf16 scores: ties are the point
            scores, n = _scores(rng, b, s, t, ties=ties, dtype=dtype)
            got, want = IMPLS[impl](scores, n, bs), reference.block_max(scores, n, bs)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                          err_msg=f"shape {(b, s, t)}, block {bs}, {jnp.dtype(dtype).name}")


def test_unmasked_scores_and_stale_tail():
    """Scores past n_p that were not masked still count (the kernel masks only past T, as the reference)."""
    rng = np.random.default_rng(5)
    scores = jnp.asarray(rng.standard_normal((2, 3, 45)), jnp.float32)
    n = jnp.asarray([[0, 1, 45], [8, 9, 17]], jnp.int32)
    for impl in IMPLS.values():
        np.testing.assert_array_equal(impl(scores, n, 8), reference.block_max(scores, n, 8))


@pytest.mark.parametrize("ties", [False, True])
def test_candidate_block_ids_match_indexer(ties):
    rng = np.random.default_rng(10 + int(ties))
    for b, s, t, bs in SHAPES:
        scores, n = _scores(rng, b, s, t, ties=ties)
        nb = -(-t // bs)
        for n_blocks in sorted({1, 2, max(1, nb // 2), nb, nb + 3}):
            want = indexer.candidate_block_ids(scores, n, bs, n_blocks)
            for backend in bm.BACKENDS:
                got = bm.candidate_block_ids(scores, n, bs, n_blocks, backend=backend)
                np.testing.assert_array_equal(got, want, err_msg=f"{backend} {(b, s, t, bs)} k={n_blocks}")


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,t", [(8, 1, 1 << 20), (128, 1, 4099), (2, 64, 2053)])
def test_api_pallas_on_device(b, s, t):
    """The api's GPU path (``mosaic.block_max``, then the selection) == the reference and the indexer."""
    for ties in (False, True):
        scores, n = _scores(np.random.default_rng(t), b, s, t, ties=ties)
        np.testing.assert_array_equal(bm.block_max(scores, n, 8, backend="pallas"), reference.block_max(scores, n, 8))
        np.testing.assert_array_equal(bm.candidate_block_ids(scores, n, 8, 2048, backend="pallas"),
                                      indexer.candidate_block_ids(scores, n, 8, 2048))


@pytest.mark.parametrize("ties", [False, True])
def test_radix_selection_equals_top_k(ties):
    """The sort-free selection keeps lax.top_k's blocks (ties lower-index-first), ascending, −1 padded: over
    causal masks with fully masked rows, the pinned newest block, heavy ties, and k above the block count."""
    rng = np.random.default_rng(10 + int(ties))
    for b, s, t, bs in SHAPES + [(1, 2, 4096, 4)]:
        scores, n = _scores(rng, b, s, t, ties=ties)
        bmax = bm.block_max(scores, n, bs)
        nb = bmax.shape[-1]
        for k in sorted({1, max(1, nb // 3), nb + 5}):  # one, some, more than there are
            want = _select(bmax, k, "top_k")
            got = _select(bmax, k, "radix")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{(b, s, t, bs)} k={k}")


_select = jax.jit(lambda m, k, sel: bm.select_blocks(m, k, selection=sel), static_argnums=(1, 2))


def test_prefix_counts_are_exact_over_many_chunks():
    """The matmul prefix sums of two disjoint flag rows equal numpy's cumsum over rows of many 256-chunks (and a
    ragged tail), dense and sparse flags: the sums are exact, not rounded by bf16 or tf32."""
    from pallas_kernels.block_max.select import disjoint_prefix_counts

    rng = np.random.default_rng(3)
    for n in (1, 255, 257, 70001):
        for p in (0.999, 0.5, 0.01):
            a = rng.random((3, n)) < p
            b = (rng.random((3, n)) < 0.5) & ~a
            got_a, got_b = jax.jit(disjoint_prefix_counts)(jnp.asarray(a), jnp.asarray(b))
            for got, want in ((got_a, a), (got_b, b)):
                got = np.asarray(got)
                assert got.shape[1] == -(-n // 256) * 256
                np.testing.assert_array_equal(got[:, :n], np.cumsum(want, axis=-1), err_msg=f"n={n} p={p}")
                np.testing.assert_array_equal(got[:, n:], np.broadcast_to(got[:, n - 1:n], got[:, n:].shape))


def test_radix_select_at_the_release_width():
    """2048 of 131072 block maxima (a 1M-position row) with a heavy tie at the threshold."""
    from pallas_kernels.block_max.select import select_top_blocks

    rng = np.random.default_rng(4)
    bmax = rng.standard_normal((2, 131072)).astype(np.float32)
    bmax[0, rng.choice(131072, 5000, replace=False)] = 2.5  # 5000 ties straddle the 2048th place
    bmax[1, 100000:] = -np.inf
    vals, idx = jax.lax.top_k(jnp.asarray(bmax), 2048)
    want = np.sort(np.where(np.asarray(vals) > -np.inf, np.asarray(idx), 131072), axis=-1)
    want = np.where(want < 131072, want, -1)
    got = np.asarray(jax.jit(select_top_blocks, static_argnums=1)(jnp.asarray(bmax), 2048))
    np.testing.assert_array_equal(got, want)
    assert bmax.shape[-1] >= bm.RADIX_MIN_BLOCKS  # "auto" (the default) takes the radix path here
    np.testing.assert_array_equal(np.asarray(jax.jit(bm.select_blocks, static_argnums=1)(jnp.asarray(bmax), 2048)),
                                  want)


def test_radix_select_threshold_on_signs_zeros_and_infinities():
    from pallas_kernels.block_max.select import select_top_blocks

    assert np.asarray(jax.lax.top_k(jnp.asarray([-0.0, 0.0]), 1)[1]).tolist() == [1]  # the order matched

    row = np.array([-0.0, 0.0, -np.inf, np.inf, -1.5, 2.0, 2.0, -0.0, 1e-38, -1e-38, 2.0, -np.inf], np.float32)
    for k in range(1, row.size + 2):
        # lax.top_k's order: −0 below +0, then equal values by lower index
        order = sorted(range(row.size), key=lambda i: (-row[i], bool(np.signbit(row[i])), i))[: min(k, row.size)]
        want = sorted(i for i in order if row[i] > -np.inf)
        got = np.asarray(select_top_blocks(jnp.asarray(row)[None], k))[0]
        assert got[: len(want)].tolist() == want and (got[len(want):] == -1).all(), (k, got, want)


def _hard_rows(rng, r: int, n: int) -> np.ndarray:
    """Rows with ties straddling k = n // 4 (row 0), a −∞ half (last row), ±0 and ±∞ values."""
    x = rng.standard_normal((r, n)).astype(np.float32)
    x[0, rng.choice(n, n // 3, replace=False)] = 1.25
    x[-1, n // 2:] = -np.inf
    x[r // 2, :4] = [0.0, -0.0, np.inf, -np.inf]
    return x


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_radix_kernel_passes_interpreted():
    """The Mosaic GPU passes (interpreted) find the same k-th largest key as the XLA passes: several CTAs
    per row, several tiles per CTA, padded tails, heavy ties, ±0 and ±∞, a half −∞ row, k = 1, k inside
    and k = N."""
    from pallas_kernels.block_max import radix_mosaic, select

    rng = np.random.default_rng(20)
    for r, n, target in ((3, 5000, 264), (1, 20000, 2)):
        x = _hard_rows(rng, r, n)
        key = select.order_key(jnp.asarray(x))
        for k in (1, n // 4, n):
            want = np.asarray(select.kth_largest_key(key, k))
            got = np.asarray(radix_mosaic.kth_largest_key(jnp.asarray(x), k, target_ctas=target, interpret=True))
            np.testing.assert_array_equal(got, want, err_msg=f"{(r, n, target)} k={k}")
    assert radix_mosaic.geometry(1, 20000, 2) == (2, 3)  # the second case runs 3 tiles a CTA
    # the shapes timed on the H200, and the caps: <= 64 CTAs a row unless the tiles would overflow SMEM
    assert [radix_mosaic.geometry(r, n) for r, n in ((8, 131072), (128, 16384), (32, 131072))] == [
        (32, 1), (3, 2), (9, 4)]
    assert radix_mosaic.geometry(1, 1 << 20) == (64, 4)
    assert radix_mosaic.geometry(1, 1 << 22) == (128, 8) and radix_mosaic.geometry(1, (1 << 22) + 1) is None
    with pytest.raises(ValueError, match="exceed 128 CTAs"):
        radix_mosaic.kth_largest_key(jnp.zeros((1, (1 << 22) + 1)), 5)


def test_radix_cluster_search_interpreted():
    """The one-kernel search (interpreted) finds the XLA search's k-th largest key: several tiles a CTA,
    padded tails, ties, ±0, ±∞, −∞ halves, k = 1, k inside and k = N. On jax >= 0.11 the rows also span
    clusters of several CTAs (the 0.10 GPU interpreter has no cluster barriers: one CTA there)."""
    from pallas_kernels.block_max import radix_cluster, select

    rng = np.random.default_rng(21)
    ctas = radix_cluster.max_ctas(True)
    for r, n in ((3, 5000), (1, 9000), (2, 30)):
        x = _hard_rows(rng, r, n)
        key = select.order_key(jnp.asarray(x))
        for k in (1, n // 4, n):
            want = np.asarray(select.kth_largest_key(key, k))
            got = np.asarray(radix_cluster.kth_largest_key(jnp.asarray(x), k, ctas=ctas, interpret=True))
            np.testing.assert_array_equal(got, want, err_msg=f"{(r, n)} k={k}")
    assert radix_cluster.geometry(5000) == (2, 1) and radix_cluster.geometry(9000, 1) == (1, 3)
    assert [radix_cluster.geometry(n) for n in (131072, 16384, 8 * 12 * 4096)] == [(8, 4), (4, 1), (8, 12)]
    assert radix_cluster.geometry(8 * 12 * 4096 + 1) is None  # too long for one cluster: the per-pass kernels
    with pytest.raises(ValueError, match="ctas must be in"):
        radix_cluster.geometry(100, 9)
    with pytest.raises(ValueError, match="exceed the SMEM"):
        radix_cluster.kth_largest_key(jnp.zeros((1, 60000)), 5, ctas=1, interpret=True)


def test_radix_kernel_picks_by_shape():
    """``radix_kernel`` takes a kernel a pass where each of its CTAs counts one tile (8 x 131072: 67 against
    115 µs on the H200), else the one-kernel search (128 x 16384: 79 against 131 µs; 32 x 131072: 181 against
    363 µs), and the per-pass kernels for rows past one cluster."""
    from pallas_kernels.block_max import select

    assert [select.pick_kernel(r, n) for r, n in ((8, 131072), (128, 16384), (32, 131072), (1, 1 << 20))] == [
        "passes", "cluster", "cluster", "passes"]
    with pytest.raises(ValueError, match="kernel must be one of"):
        select.kth_largest(jnp.zeros((1, 8)), jnp.zeros((1, 8), jnp.uint32), 2, kernel="fast")


def test_radix_kernel_selection_interpreted():
    bmax = jnp.asarray(np.random.default_rng(5).standard_normal((2, 9000)).astype(np.float32))
    want = np.asarray(_select(bmax, 300, "top_k"))
    np.testing.assert_array_equal(np.asarray(_select(bmax, 300, "radix_kernel")), want)


def test_select_blocks_refuses_unknown_names():
    bmax = jnp.zeros((1, 8))
    with pytest.raises(ValueError, match="backend must be one of"):
        bm.select_blocks(bmax, 2, backend="cuda")
    with pytest.raises(ValueError, match="selection must be one of"):
        bm.select_blocks(bmax, 2, selection="sort")


def test_radix_kernel_lowers_to_mosaic_gpu():
    from pallas_kernels.block_max import radix_mosaic

    fn = functools.partial(radix_mosaic.kth_largest_key, k=2048)
    x = jax.ShapeDtypeStruct((8, 131072), jnp.float32)
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 8  # one kernel a pass


def test_radix_cluster_lowers_to_mosaic_gpu():
    """The one-kernel search lowers for a cuda target: clusters of 8 CTAs, the inline PTX exchange."""
    from pallas_kernels.block_max import radix_cluster

    fn = functools.partial(radix_cluster.kth_largest_key, k=2048)
    jax.jit(fn).trace(jax.ShapeDtypeStruct((8, 131072), jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
def test_radix_kernel_on_device():
    for b, t, k in ((8, 1 << 17, 2048), (32, 1 << 17, 2048), (128, 1 << 14, 2048), (3, 5000, 100)):
        rng = np.random.default_rng(t + b)
        bmax = rng.standard_normal((b, t)).astype(np.float32)
        bmax[0, rng.choice(t, t // 4, replace=False)] = 0.5  # ties at the threshold
        bmax[-1, t // 3:] = -np.inf
        bmax = jnp.asarray(bmax)
        want = np.asarray(_select(bmax, k, "top_k"))
        for sel in ("radix_kernel", "radix_passes", "radix_cluster"):
            np.testing.assert_array_equal(np.asarray(_select(bmax, k, sel)), want, err_msg=f"{(b, t, k, sel)}")


@pytest.mark.gpu
def test_radix_cluster_on_device():
    """The one-kernel search on the GPU == the XLA search, at cluster sizes 1-8, with ties, ±0, ±∞, padded
    tails and the longest row one cluster holds."""
    from pallas_kernels.block_max import radix_cluster, select

    rng = np.random.default_rng(7)
    for r, n in ((8, 1 << 17), (32, 1 << 17), (128, 1 << 14), (3, 5000), (2, 4096), (1, 8 * 12 * 4096)):
        x = _hard_rows(rng, r, n)
        key = select.order_key(jnp.asarray(x))
        for k in (1, 2048, n):
            want = np.asarray(select.kth_largest_key(key, k))
            got = np.asarray(radix_cluster.kth_largest_key(jnp.asarray(x), k))
            np.testing.assert_array_equal(got, want, err_msg=f"{(r, n)} k={k}")
