"""pallas_kernels.mhc_site: one decode site's expand, collapse and raw mixes == the model's mhc functions.

The expanded streams and the collapse are the model's sums in the model's order (equal up to an FMA's rounding
before the bf16 cast: one bf16 step at most, on the GPU); the mixes are summed per column chunk, so they
differ by fp32 rounding (relative to the largest, bounded by 1e-6 here; the terms are ~1e4 products of size
~0.02 in a sum of size ~1). Interpreted on CPU; compiled (Triton) on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import mhc
from pallas_kernels.mhc_site import fused_site, reference_site


def _operands(rng, rows: int, d: int, m: int = 4, expand: bool = True):
    y = (2 + m) * m
    f = jnp.asarray(rng.standard_normal((rows, d)) * 3, jnp.bfloat16) if expand else None
    post = jnp.asarray(rng.uniform(0, 2, (rows, m)), jnp.float32) if expand else None
    comb = jnp.asarray(rng.dirichlet(np.ones(m), (rows, m)), jnp.float32) if expand else None
    return (f, jnp.asarray(rng.standard_normal((rows, m, d)), jnp.bfloat16), post, comb,
            jnp.asarray(rng.uniform(0, 1, (rows, m)), jnp.float32),
            jnp.asarray(rng.normal(0, 0.02, (y, m * d)), jnp.float32))


def _check(got, ref, *, exact: bool):
    for name, a, b in zip(("streams", "collapse", "mixes"), got, ref, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape, name
        if name == "mixes":
            assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max(), (name, np.abs(a - b).max())
        elif exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:  # one bf16 step: an FMA may round the fp32 sum differently before the cast
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=0, err_msg=name)


# rows: one (batch 1), odd (padded to a power of two), 32 (one full row block), 40 (two row blocks, padded)
@pytest.mark.parametrize("rows,d,expand", [(1, 128, True), (3, 128, True), (32, 64, True), (40, 64, True),
                                           (2, 128, False)])
def test_fused_site_interpreted_is_the_model(rng, monkeypatch, rows, d, expand):
    """Against the model's written-out expand and collapse (GPU's decode form: the same sums in the same order;
    the CPU's products sum in another)."""
    monkeypatch.setattr(mhc, "_written_out", lambda x: True)
    ops = _operands(rng, rows, d, expand=expand)
    _check(fused_site(*ops, 1e-6, interpret=True), reference_site(*ops, 1e-6), exact=True)


def test_fused_site_rejects_bad_shapes(rng):
    f, x, post, comb, pre, fn = _operands(rng, 2, 64)
    with pytest.raises(ValueError, match=r"fn is \(24, 128\), expected \[Y, 256\]"):
        fused_site(f, x, post, comb, pre, fn[:, :128], 1e-6, interpret=True)
    with pytest.raises(ValueError, match="width 48 is not a multiple of 64"):
        fused_site(f[:, :48], x[..., :48], post, comb, pre, fn[:, :192], 1e-6, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 128])
def test_fused_site_on_gpu(rng, rows):
    """The compiled kernel at the engine-bench width (2048) and the release's (4096)."""
    for d in (2048, 4096):
        ops = _operands(rng, rows, d)
        got = jax.jit(lambda *a: fused_site(*a, 1e-6))(*ops)
        _check(got, jax.jit(lambda *a: reference_site(*a, 1e-6))(*ops), exact=False)
