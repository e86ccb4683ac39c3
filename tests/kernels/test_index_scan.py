"""``pallas_kernels.index_scan``: the packed-key index scan equals the model's index score over unpacked keys.

Without a GPU the Triton kernel runs in the Pallas interpreter against the reference (unpack, then
:func:`dsv41_jax.model.indexer.index_scores`): fp32 accumulation of exact bf16 × bf16 products on both sides, so
the bound is fp32 summation order, held at 1e-6 of the row's largest |term| sum; on the CPU the two came out
bit-equal. Cases: cache lengths that end inside a block, heads padded to the tensor cores' 16 rows, several query
rows, batch > 1, and scale bytes across E8M0's range. The kernel's lowering to Triton for a cuda target is
checked on the CPU too. Marked gpu: the compiled kernel against an fp64 NumPy score, and ``backend="pallas"``
(the kernel at decode shapes, the unpack kernel + XLA above ``MAX_QUERIES`` rows) against ``"xla"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels.index_scan import api, reference, triton


def _inputs(b=2, s=1, n=4, i=128, t=300, seed=0, wide_scales=False):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((b, t, i))
    if wide_scales:  # groups of 32 lanes spread over 2^-60 .. 2^60
        keys = keys * 2.0 ** rng.integers(-60, 60, (b, t, i // 32)).repeat(32, axis=-1)
    codes, exps = quant.pack_mxfp4(jnp.asarray(keys, jnp.float32))
    iq = quant.qdq_mxfp4(jnp.asarray(rng.standard_normal((b, s, n, i)), jnp.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, s, n)), jnp.float32)
    return iq, w, codes, exps


def _terms(iq, w, codes, exps):
    """fp64 score and the sum of its terms' magnitudes (the scale of fp32 summation error)."""
    k = np.asarray(quant.unpack_mxfp4(codes, exps, jnp.float32), np.float64)
    q = np.asarray(iq.astype(jnp.float32), np.float64)
    dots = np.einsum("bsni,bti->bsnt", q, k)
    mag = np.einsum("bsni,bti->bsnt", np.abs(q), np.abs(k))
    w = np.asarray(w, np.float64)
    return np.einsum("bsn,bsnt->bst", w, np.maximum(dots, 0)), np.einsum("bsn,bsnt->bst", np.abs(w), mag)


CASES = {
    "decode, ragged last block": dict(t=300),
    "32 heads, batch 3": dict(b=3, n=32, t=256),
    "several query rows": dict(s=3, n=8, t=129),
    "one short block": dict(b=1, t=5),
    "scales across E8M0": dict(t=200, wide_scales=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [32, 128])
def test_kernel_equals_the_reference(case, block):
    x = _inputs(**CASES[case])
    got = np.asarray(triton.index_scores(*x, block=block, interpret=True))
    want = np.asarray(reference.index_scores(*x))
    exact, mag = _terms(*x)
    assert got.shape == want.shape == exact.shape
    assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), case
    assert np.all(np.abs(got - exact) <= 1e-6 * mag + 1e-30), case


def test_bad_arguments_are_named():
    iq, w, codes, exps = _inputs()
    with pytest.raises(ValueError, match="codes"):
        triton.index_scores(iq, w, codes[..., :32], exps, interpret=True)
    with pytest.raises(ValueError, match="block"):
        triton.index_scores(iq, w, codes, exps, block=48, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        api.index_scores(iq, w, codes, exps, backend="cuda")


def test_pallas_backend_off_gpu_is_the_reference_bit_for_bit():
    x = _inputs(n=8, t=96)
    np.testing.assert_array_equal(np.asarray(api.index_scores(*x, backend="pallas")),
                                  np.asarray(api.index_scores(*x, backend="xla")))


def test_kernel_lowers_to_triton_for_cuda():
    sd = jax.ShapeDtypeStruct
    args = (sd((32, 1, 32, 128), jnp.bfloat16), sd((32, 1, 32), jnp.float32), sd((32, 65536, 64), jnp.uint8),
            sd((32, 65536, 4), jnp.uint8))
    text = jax.jit(triton.index_scores).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "index_scan" in text


@pytest.fixture
def gpu_kernel(monkeypatch):
    monkeypatch.setattr(api, "GPU_KERNEL", True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [dict(b=1, n=32, t=2112), dict(b=32, n=32, t=8192, seed=1),
                                   dict(b=4, s=3, n=32, t=1000, seed=2)])
def test_kernel_on_gpu(shape, gpu_kernel):
    x = _inputs(**shape)
    got = np.asarray(api.index_scores(*x, backend="pallas"))
    exact, mag = _terms(*x)
    assert np.all(np.abs(got - exact) <= 1e-6 * mag + 1e-30)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(api.index_scores(*x, backend="xla"))
    assert np.all(np.abs(got - want) <= 2e-6 * mag + 1e-30)


@pytest.mark.gpu
def test_pallas_backend_above_max_queries_on_gpu(gpu_kernel):
    x = _inputs(b=2, s=api.MAX_QUERIES + 1, n=32, t=700)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(api.index_scores(*x, backend="pallas"))
    exact, mag = _terms(*x)
    assert np.all(np.abs(got - exact) <= 1e-6 * mag + 1e-30)
