"""fp4_pack kernels == dsv41_jax.quant.pack_nvfp4 / pack_mxfp4, byte for byte (spec attention §7.2-7.4).

Every implementation runs the same cases: the TPU kernel body in interpret mode on CPU, the public API,
and (marked gpu) the API's compiled GPU kernel (``direct.pack``) on the device. The Mosaic GPU kernels'
own cases (interpreted, lowered and on the device) are in test_mosaic_gpu.py.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import fp4_pack
from pallas_kernels.fp4_pack import tpu

REFERENCE = {"nvfp4": quant.pack_nvfp4, "mxfp4": quant.pack_mxfp4}
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0])  # E2M1 midpoints + grid
E4M3_GRID = np.array([m * 2.0**e for e in range(-6, 8) for m in (1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875)]
                     + [k * 2.0**-9 for k in range(1, 8)])


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_same(got, want):
    for g, w, name in zip(got, want, ("codes", "scales"), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        np.testing.assert_array_equal(_bytes(g), _bytes(w), err_msg=name)


def _ties(rng, rows: int, n: int, fmt: str) -> np.ndarray:
    """Groups whose elements sit exactly on E2M1 midpoints times a scale the format reproduces exactly."""
    block = 16 if fmt == "nvfp4" else 32
    g = n // block
    t = rng.choice(TIES, size=(rows, g, block)) * rng.choice([-1.0, 1.0], size=(rows, g, block))
    if fmt == "nvfp4":  # amax = 6 s, so amax / 6 = s exactly and x / s = t exactly
        s, top = rng.choice(E4M3_GRID, size=(rows, g, 1)), 6.0
    else:  # amax = 4 s or 5 s: ceil(log2(amax / 6)) = log2 s; 5 is itself a tie (-> 4)
        s, top = 2.0 ** rng.integers(-30, 30, size=(rows, g, 1)), rng.choice([4.0, 5.0], size=(rows, g, 1))
    t[..., :1] = top * np.sign(rng.standard_normal((rows, g, 1)))
    return (t * s).reshape(rows, n).astype(np.float32)


def _cases(fmt: str, n: int):
    rng = np.random.default_rng(n + len(fmt))
    yield "normal", rng.standard_normal((37, n)).astype(np.float32) * 3
    yield "scales", (rng.standard_normal((24, n)) * 2.0 ** rng.integers(-24, 24, (24, 1))).astype(np.float32)
    yield "ties", _ties(rng, 20, n, fmt)
    sat = rng.standard_normal((6, n)).astype(np.float32)
    sat[0] *= 1e4  # nvfp4 scale saturates at 448: x / s past ±6 is clipped
    sat[1] = np.sign(sat[1]) * 6.3  # amax / 6 = 1.05 rounds down to scale 1: every |x / s| = 6.3 -> 6
    sat[2] = 0.0
    sat[3] = -0.0  # codes keep the sign bit (-0 -> 8)
    sat[4] *= 1e-5  # below the amax floors
    sat[5, ::3] = 0.0
    yield "saturation_zero", sat


def _all_cases(fmt: str, n: int) -> np.ndarray:
    """Every case stacked into one [R, n] array (one kernel call; R is not a multiple of the row tile)."""
    return np.concatenate([x for _, x in _cases(fmt, n)])


IMPLS = {
    "tpu_interpret": functools.partial(tpu.pack, rows_per_step=32, interpret=True),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 128), ("mxfp4", 512)])
def test_matches_reference(impl, fmt, n):
    x = _all_cases(fmt, n)
    for dtype in (jnp.float32, jnp.bfloat16):
        xj = jnp.asarray(x, dtype)
        assert_same(IMPLS[impl](xj, fmt), REFERENCE[fmt](xj))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ragged_and_empty_rows(fmt):
    rng = np.random.default_rng(1)
    for shape in ((0, 128), (2, 0, 128), (3, 128), (2, 3, 11, 128)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for impl in IMPLS.values():
            assert_same(impl(x, fmt), REFERENCE[fmt](x))


def test_api_backends_agree():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, 512)), jnp.float32)
    assert_same(fp4_pack.pack_nvfp4(x, backend="pallas"), fp4_pack.pack_nvfp4(x, backend="xla"))
    k = x[..., :128]
    assert_same(fp4_pack.pack_mxfp4(k, backend="pallas"), fp4_pack.pack_mxfp4(k, backend="xla"))
    with pytest.raises(ValueError, match="backend"):
        fp4_pack.pack_nvfp4(x, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128)])
def test_api_pallas_on_device(fmt, n):
    """The api's GPU pack (``direct.pack``) on every case in both dtypes, and on rows past its last whole CTA."""
    pack = fp4_pack.pack_nvfp4 if fmt == "nvfp4" else fp4_pack.pack_mxfp4
    for name, x in _cases(fmt, n):
        for dtype in (jnp.float32, jnp.bfloat16):
            xj = jnp.asarray(x, dtype)
            try:
                assert_same(pack(xj, backend="pallas"), REFERENCE[fmt](xj))
            except AssertionError as e:
                raise AssertionError(f"case {name}, {jnp.dtype(dtype).name}") from e
    big = jnp.asarray(np.random.default_rng(3).standard_normal((4099, n)), jnp.bfloat16)  # a ragged tail
    assert_same(pack(big, backend="pallas"), REFERENCE[fmt](big))
