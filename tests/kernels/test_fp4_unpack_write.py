"""fp4_pack unpack and fused cache-write kernels == the engine's jnp path, byte for byte (spec attention §7.4).

Unpack: every (code byte, scale byte) pair of both formats, so every nibble code on both halves and every
scale byte including zero, subnormal E4M3, saturation (448) and NaN encodings, in f32 and bf16, against
``quant.unpack_*``. Write: pack-then-``.at[index].set(mode="drop")`` on caches of random bytes, with
slots at the end of the cache, dropped rows, negative slots and sequences of different lengths.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import fp4_pack
from pallas_kernels.fp4_pack import direct, mosaic, reference, tpu

UNPACK = {"nvfp4": quant.unpack_nvfp4, "mxfp4": quant.unpack_mxfp4}
WRITE = {"nvfp4": reference.write_nvfp4, "mxfp4": reference.write_mxfp4}
BLOCK = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPE = {"nvfp4": jnp.float8_e4m3fn, "mxfp4": jnp.uint8}

UNPACK_IMPLS = {
    "tpu_interpret": functools.partial(tpu.unpack, rows_per_step=32, interpret=True),
    "mosaic_interpret": functools.partial(mosaic.unpack, interpret=True),
}
WRITE_IMPLS = {
    "tpu_interpret": functools.partial(tpu.write, rows_per_step=4, interpret=True),
    "mosaic_interpret": functools.partial(mosaic.write, interpret=True),
}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bits(got, want, msg: str = ""):
    """Same bits. NaN payloads are checked last and reported apart: NaN comes only from NaN scale bytes
    (E4M3 S.1111.111, E8M0 255), which the pack never writes, and GPUs canonicalise NaN results."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{msg}: {got.shape} {got.dtype} vs {want.shape} " \
                                                                f"{want.dtype}"
    g, w = _bits(got), _bits(want)
    if w.dtype.itemsize > 1:  # values (f32, bf16); 1-byte codes and scale bytes compare as they are
        nan = np.isnan(np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)), nan, err_msg=f"{msg}: NaN positions")
        np.testing.assert_array_equal(g[~nan], w[~nan], err_msg=f"{msg}: non-NaN values")
        np.testing.assert_array_equal(g[nan], w[nan], err_msg=f"{msg}: only NaN payloads differ")
    np.testing.assert_array_equal(g, w, err_msg=msg)


def _scales(fmt: str, b: np.ndarray):
    b = jnp.asarray(b, jnp.uint8)
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn) if fmt == "nvfp4" else b


def _every_pair(fmt: str, n: int):
    """Codes [R, n/2] and scales [R, n/block] holding every (code byte, scale byte) pair once."""
    g, h = n // BLOCK[fmt], BLOCK[fmt] // 2
    groups = 256 * 256 // h  # each group: one scale byte and h code bytes
    scale = np.repeat(np.arange(256), 256 // h)  # [groups]
    codes = np.tile(np.arange(256), 256).reshape(groups, h)
    rows = groups // g
    return jnp.asarray(codes.reshape(rows, g * h), jnp.uint8), _scales(fmt, scale.reshape(rows, g))


def _random_codes(fmt: str, shape, seed: int):
    rng = np.random.default_rng(seed)
    *lead, n = shape
    codes = jnp.asarray(rng.integers(0, 256, (*lead, n // 2)), jnp.uint8)
    return codes, _scales(fmt, rng.integers(0, 256, (*lead, n // BLOCK[fmt])))


@pytest.mark.parametrize("impl", sorted(UNPACK_IMPLS))
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 64), ("mxfp4", 64)])
def test_unpack_every_code_and_scale_byte(impl, fmt, n):
    codes, scales = _every_pair(fmt, n)
    for dtype in (jnp.float32, jnp.bfloat16):
        assert_bits(UNPACK_IMPLS[impl](codes, scales, fmt, dtype), UNPACK[fmt](codes, scales, dtype),
                    f"{fmt} {n} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_unpack_ragged_and_empty_rows(fmt):
    for i, shape in enumerate(((0, 128), (2, 0, 128), (3, 128), (2, 3, 11, 128), (37, 512))):
        codes, scales = _random_codes(fmt, shape, i)
        for impl in UNPACK_IMPLS.values():
            assert_bits(impl(codes, scales, fmt, jnp.bfloat16), UNPACK[fmt](codes, scales, jnp.bfloat16), str(shape))


def test_unpack_inverts_pack_through_the_api():
    """unpack(pack(x)) through the pallas backend equals the fake quant (the engine's read of its own write)."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, 512)) * 4, jnp.float32)
    got = fp4_pack.unpack_nvfp4(*fp4_pack.pack_nvfp4(x, backend="pallas"), backend="pallas")
    assert_bits(got, quant.qdq_nvfp4(x))
    k = x[..., :128]
    assert_bits(fp4_pack.unpack_mxfp4(*fp4_pack.pack_mxfp4(k, backend="pallas"), backend="pallas"), quant.qdq_mxfp4(k))
    with pytest.raises(ValueError, match="backend"):
        fp4_pack.unpack_mxfp4(*quant.pack_mxfp4(k), backend="triton")
    with pytest.raises(ValueError, match="do not describe groups"):
        tpu.unpack(jnp.zeros((3, 64), jnp.uint8), jnp.zeros((3, 5), jnp.uint8), "nvfp4")


def _write_case(fmt: str, b: int, t: int, s: int, n: int, seed: int):
    """Caches of random bytes, new rows, and per-sequence slots: distinct live slots (the last entry of
    the cache among them), padding rows at slot t, one at t + 5, one negative slot (counts from the end)."""
    rng = np.random.default_rng(seed)
    codes, scales = _random_codes(fmt, (b, t, n), seed)
    x = rng.standard_normal((b, s, n)).astype(np.float32) * 2.0 ** rng.integers(-8, 8, (b, s, 1))
    x[0, 0] = 0.0
    index = np.full((b, s), t)
    for i in range(b):
        live = int(rng.integers(0, s + 1)) if i else s  # sequences of different lengths; the first is full
        if live:
            index[i, :live] = rng.permutation(np.append(rng.choice(t - 1, live - 1, replace=False), t - 1))
    index[-1, -1] = t + 5
    if s > 1 and b > 1 and index[1, 0] < t:
        index[1, 0] = index[1, 0] - t  # the same slot, counted from the end
    return codes, scales, jnp.asarray(x), jnp.asarray(index, jnp.int32)


@pytest.mark.parametrize("impl", sorted(WRITE_IMPLS))
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 64)])
def test_write_matches_pack_then_scatter(impl, fmt, n):
    # decode (one row per sequence), a ragged prefill chunk over 3 row tiles, a chunk that fills the cache
    for seed, (b, t, s, dtype) in enumerate([(3, 16, 1, jnp.float32), (3, 20, 10, jnp.bfloat16),
                                             (1, 9, 9, jnp.float32)]):
        codes, scales, x, index = _write_case(fmt, b, t, s, n, seed)
        x = x.astype(dtype)
        got, want = WRITE_IMPLS[impl](codes, scales, x, index, fmt), WRITE[fmt](codes, scales, x, index)
        for g, w, name in zip(got, want, ("codes", "scales"), strict=True):
            assert_bits(g, w, f"{name} {(b, t, s)} {jnp.dtype(dtype).name}")


def test_write_api_backends_agree_and_empty_chunk():
    for fn, fmt in ((fp4_pack.write_nvfp4, "nvfp4"), (fp4_pack.write_mxfp4, "mxfp4")):
        codes, scales, x, index = _write_case(fmt, 2, 12, 5, 64, 7)
        for g, w in zip(fn(codes, scales, x, index, backend="pallas"), fn(codes, scales, x, index, backend="xla"),
                        strict=True):
            assert_bits(g, w, fmt)
        for impl in WRITE_IMPLS.values():  # a chunk of no rows leaves the caches as they were
            for g, w in zip(impl(codes, scales, x[:, :0], index[:, :0], fmt), (codes, scales), strict=True):
                assert_bits(g, w, f"{fmt} empty chunk")


def test_tpu_kernels_lower_to_mosaic():
    """Pallas -> Mosaic TPU lowering (block shapes, scalar prefetch, DMAs) without a TPU; untested on hardware."""
    sds = jax.ShapeDtypeStruct
    for fmt in ("nvfp4", "mxfp4"):
        g, sd = 512 // BLOCK[fmt], SCALE_DTYPE[fmt]
        for fn, args in ((tpu.unpack, (sds((300, 256), jnp.uint8), sds((300, g), sd))),
                         (tpu.write, (sds((2, 64, 256), jnp.uint8), sds((2, 64, g), sd), sds((2, 9, 512), jnp.bfloat16),
                                      sds((2, 9), jnp.int32)))):
            text = jax.jit(functools.partial(fn, fmt=fmt)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 1024)])
def test_gpu_unpack_on_device(fmt, n):
    """The GPU unpack (``mosaic.unpack``, the api's) at its default tile and at 128 and 512 groups a tile."""
    fn = mosaic.unpack
    codes, scales = _every_pair(fmt, n)
    big = _random_codes(fmt, (4099, n), 3)  # ragged last tile
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows_per_step in (None, 1, 4):
            if rows_per_step:  # whole multiples of 128 groups per tile
                rows_per_step *= 128 // math.gcd(128, n // BLOCK[fmt])
            assert_bits(fn(codes, scales, fmt, dtype, rows_per_step=rows_per_step),
                        UNPACK[fmt](codes, scales, dtype), f"every pair, {jnp.dtype(dtype).name}, {rows_per_step}")
        assert_bits(fn(*big, fmt, dtype), UNPACK[fmt](*big, dtype), "4099 rows")
        assert_bits(fn(*_random_codes(fmt, (3, n), 4), fmt, dtype), UNPACK[fmt](*_random_codes(fmt, (3, n), 4), dtype),
                    "3 rows")
    fn = fp4_pack.unpack_nvfp4 if fmt == "nvfp4" else fp4_pack.unpack_mxfp4
    assert_bits(fn(*big, backend="pallas"), UNPACK[fmt](*big))


@pytest.mark.skipif(not direct.FUSED_WRITE, reason="the fused GPU write updates its caches in place through "
                    "kernel refs, which need jax >= 0.11 (older jax packs, then scatters)")
@pytest.mark.parametrize("fmt,n,dtype", [("nvfp4", 512, jnp.bfloat16), ("mxfp4", 128, jnp.bfloat16),
                                         ("nvfp4", 512, jnp.float32)])
def test_fused_write_lowers_in_place(fmt, n, dtype):
    """The fused GPU write lowers for a cuda target as one Mosaic GPU kernel whose caches alias its outputs."""
    g = n // BLOCK[fmt]
    sd = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
    args = (jax.ShapeDtypeStruct((3, 300, n // 2), jnp.uint8), jax.ShapeDtypeStruct((3, 300, g), sd),
            jax.ShapeDtypeStruct((3, 77, n), dtype), jax.ShapeDtypeStruct((3, 77), jnp.int32))
    text = jax.jit(functools.partial(direct.write, fmt=fmt), donate_argnums=(0, 1)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_alias" in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n", [("nvfp4", 512), ("mxfp4", 128)])
def test_gpu_write_on_device(fmt, n):
    for seed, (b, t, s) in enumerate([(8, 64, 1), (3, 300, 77), (2, 4096, 4096)]):
        codes, scales, x, index = _write_case(fmt, b, t, s, n, seed)
        for dtype in (jnp.float32, jnp.bfloat16):
            xd = x.astype(dtype)
            want = WRITE[fmt](codes, scales, xd, index)
            for g, w, name in zip(mosaic.write(codes, scales, xd, index, fmt), want, ("codes", "scales"), strict=True):
                assert_bits(g, w, f"mosaic {name} {(b, t, s)} {jnp.dtype(dtype).name}")
            api_write = fp4_pack.write_nvfp4 if fmt == "nvfp4" else fp4_pack.write_mxfp4  # GPU: direct.write
            for g, w, name in zip(api_write(codes, scales, xd, index, backend="pallas"), want, ("codes", "scales"),
                                  strict=True):
                assert_bits(g, w, f"api pallas {name} {(b, t, s)} {jnp.dtype(dtype).name}")
            for g, w, name in zip(direct.write(codes, scales, xd, index, fmt, groups_per_cta=128), want,
                                  ("codes", "scales"), strict=True):  # more CTAs, a shorter tail
                assert_bits(g, w, f"direct 128 {name} {(b, t, s)} {jnp.dtype(dtype).name}")
