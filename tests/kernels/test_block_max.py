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
from pallas_kernels.block_max import gpu, reference, tpu

IMPLS = {
    "tpu_interpret": functools.partial(tpu.block_max, blocks_per_step=8, interpret=True),
    "gpu_interpret": functools.partial(gpu.block_max, rows_per_step=4, blocks_per_step=8, interpret=True),
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


def test_gpu_kernel_lowers_to_triton():
    scores = jax.ShapeDtypeStruct((8, 1, 1 << 14), jnp.float32)
    n = jax.ShapeDtypeStruct((8, 1), jnp.int32)
    text = jax.jit(functools.partial(gpu.block_max, block_size=8)).trace(scores, n).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,t", [(8, 1, 1 << 20), (128, 1, 4099), (2, 64, 2053)])
def test_gpu_kernel_on_device(b, s, t):
    for ties in (False, True):
        scores, n = _scores(np.random.default_rng(t), b, s, t, ties=ties)
        np.testing.assert_array_equal(gpu.block_max(scores, n, 8), reference.block_max(scores, n, 8))
        np.testing.assert_array_equal(bm.candidate_block_ids(scores, n, 8, 2048, backend="pallas"),
                                      indexer.candidate_block_ids(scores, n, 8, 2048))


@pytest.mark.parametrize("ties", [False, True])
def test_radix_selection_equals_top_k(ties):
    """The sort-free selection keeps lax.top_k's blocks (ties lower-index-first), ascending, −1 padded: over
    causal masks with fully masked rows, the pinned newest block, heavy ties, and k above the block count."""
    rng = np.random.default_rng(10 + int(ties))
    for b, s, t, bs in SHAPES + [(2, 3, 2048, 8), (1, 2, 4096, 4)]:
        scores, n = _scores(rng, b, s, t, ties=ties)
        nb = -(-t // bs)
        for k in sorted({1, 3, max(1, nb // 3), nb, nb + 5}):
            want = bm.candidate_block_ids(scores, n, bs, k)
            got = bm.candidate_block_ids(scores, n, bs, k, selection="radix")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{(b, s, t, bs)} k={k}")


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
