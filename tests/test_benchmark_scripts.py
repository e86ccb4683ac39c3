"""The benchmark scripts' own alternatives compute what they are compared with (they run on the device; here
only their math, on CPU, at tiny shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from test_entry_points import load_script


def test_gather_vjp_variants_agree():
    """The three backwards of the top-k gather timed by benchmarks/gather_vjp.py: the fp32 scatter and the sorted
    fp32 scatter are the exact sum rounded once; the autodiff scatter in bf16 rounds at every collision."""
    bench = load_script("benchmarks/gather_vjp.py")
    rng = np.random.default_rng(0)
    s, k, t, h = 64, 16, 32, 8
    visible = np.maximum((np.arange(s) + 1) // 2, 1)[None, :, None]
    idx = jnp.asarray((rng.random((1, s, k)) * visible).astype(np.int32))
    for dtype in (jnp.float32, jnp.bfloat16):
        kv = jnp.asarray(rng.standard_normal((1, t, h)), dtype)
        g = jnp.asarray(rng.standard_normal((1, s, k, h)), dtype)
        want = np.zeros((t, h))
        np.add.at(want, np.asarray(idx)[0], np.asarray(g.astype(jnp.float32))[0])
        out = {name: np.asarray(jax.jit(fn)(kv, idx, g).astype(jnp.float32))[0]
               for name, fn in bench.variants().items()}
        exact = np.asarray(jnp.asarray(want, dtype).astype(jnp.float32))  # the float64 sum, rounded once
        tol = dict(rtol=1e-6, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2**-8, atol=2**-8)
        for name in ("fp32", "sorted_fp32"):
            np.testing.assert_allclose(out[name], exact, **tol, err_msg=name)
        if dtype == jnp.float32:
            np.testing.assert_allclose(out["autodiff_bf16"], exact, **tol)
        else:  # rounding at every collision is worse than rounding once
            assert np.abs(out["autodiff_bf16"] - exact).max() > 4 * np.abs(out["fp32"] - exact).max()
