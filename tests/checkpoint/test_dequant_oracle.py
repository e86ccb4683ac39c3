"""Both dequantisation paths against a numpy oracle built from the bit layouts of spec model §2.2.

The converter's band producer (``plan.produce``, numpy, writes bf16/fp32 checkpoints) and the native
model's on-the-fly decode (``Linear`` / ``StackedLinear`` / ``Table`` with ``native=True``, XLA) see random
bytes that include every special: E4M3 negative zero, ±448 and NaN; every E2M1 code (code 8 = −0, ±6);
E8M0 bytes 0 (2^-127), 1, 127, 254 (2^127) and 255 (NaN).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.checkpoint.plan import Output, bands, chunk_shape, produce
from dsv41_jax.checkpoint.safetensors import ShardedCheckpoint, save_file
from dsv41_jax.model.engram import Table
from dsv41_jax.model.layers import Linear
from dsv41_jax.model.moe import StackedLinear


def e4m3(byte: int) -> float:
    """OCP E4M3 (fn): bias 7, subnormals at exponent 0, S.1111.111 is NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    return sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


E4M3 = np.array([e4m3(b) for b in range(256)])
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2) * np.repeat([1.0, -1.0], 8)  # bit 3 = sign
E8M0 = np.array([2.0 ** (b - 127) for b in range(255)] + [math.nan])


def oracle_fp8(w: np.ndarray, s: np.ndarray, br: int, bc: int) -> np.ndarray:
    r, c = np.indices(w.shape)
    return E4M3[w] * E8M0[s[r // br, c // bc]]  # float64; the product is exact


def oracle_fp4(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    col = np.arange(2 * packed.shape[-1])
    codes = (packed[..., col // 2] >> (4 * (col % 2))) & 0xF  # low nibble = even column
    return E2M1[codes] * E8M0[s[..., col // 32]]


def same(got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise equal after rounding the float64 oracle to ``got``'s dtype (NaN payloads aside)."""
    with np.errstate(over="ignore"):  # E8M0 254 times a large value is inf in f32 and bf16, as it should be
        want = want.astype(got.dtype)
    assert (np.isnan(got.astype(np.float32)) == np.isnan(want.astype(np.float32))).all()
    ok = ~np.isnan(want.astype(np.float32))
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(uint)[ok], want.view(uint)[ok])


def special_bytes(rng, shape, specials, low: int = 0) -> np.ndarray:
    b = rng.integers(low, 256, shape, dtype=np.uint8)
    flat = b.reshape(-1)
    flat[: len(specials)] = specials  # every special present at least once
    rng.shuffle(flat)
    return b


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(0)
    e8m0_specials = [0, 1, 127, 254, 255]
    t = {
        "w8": special_bytes(rng, (96, 160), [0x80, 0x00, 0x7E, 0xFE, 0x7F, 0xFF, 0x01, 0x81]),
        "s8": special_bytes(rng, (3, 5), e8m0_specials),
        "w4": special_bytes(rng, (48, 64), [0x80, 0x08, 0x77, 0xFF, 0x0F, 0xF0]),  # [48, 128] logical
        "s4": special_bytes(rng, (48, 4), e8m0_specials),
        "t8": special_bytes(rng, (70, 64), [0x80, 0x7E, 0xFE, 0x7F]),  # Engram rows: per-row scales
        "ts": special_bytes(rng, (70, 2), e8m0_specials),
    }
    stored = {"w8": ml_dtypes.float8_e4m3fn, "t8": ml_dtypes.float8_e4m3fn, "w4": np.int8}
    hf_dir = tmp_path_factory.mktemp("src")
    save_file({k: v.view(stored.get(k, ml_dtypes.float8_e8m0fnu)) for k, v in t.items()},
              hf_dir / "model.safetensors")
    return ShardedCheckpoint(hf_dir), t


def _convert(out: Output, ckpt, budget: int) -> np.ndarray:
    """What the converter writes, band by band, with a budget that makes ragged bands."""
    result = np.empty(out.shape, out.dtype)
    chunks = chunk_shape(out.shape, out.dtype.itemsize, budget)
    regions = list(bands(out.shape, chunks))
    assert len(regions) > 1
    for region in regions:
        result[region] = produce(out, ckpt, region)
    return result


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_converter_fp8_blocks(source, dtype):
    ckpt, t = source
    out = Output("w", (96, 160), np.dtype(dtype), "fp8", ("w8",), ("s8",), (32, 32))
    same(_convert(out, ckpt, 40 * 160 * 4), oracle_fp8(t["w8"], t["s8"], 32, 32))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_converter_fp4_rows(source, dtype):
    ckpt, t = source
    out = Output("w", (48, 128), np.dtype(dtype), "fp4", ("w4",), ("s4",), (1, 32))
    same(_convert(out, ckpt, 7 * 128 * 4), oracle_fp4(t["w4"], t["s4"]))


def test_converter_engram_rows(source):
    ckpt, t = source
    out = Output("t", (70, 64), np.dtype(np.float32), "fp8", ("t8",), ("ts",), (1, 32))
    same(_convert(out, ckpt, 9 * 64 * 4), oracle_fp8(t["t8"], t["ts"], 1, 32))


def test_converter_stacks_experts_in_order(source):
    ckpt, t = source
    out = Output("e", (2, 48, 128), np.dtype(np.float32), "fp4", ("w4", "w4"), ("s4", "s4"), (1, 32), stacked=True)
    got = _convert(out, ckpt, 30 * 128 * 4)
    same(got, np.stack([oracle_fp4(t["w4"], t["s4"])] * 2))


def test_converter_native_keeps_bytes(source):
    ckpt, t = source
    for name, dtype in (("w8", ml_dtypes.float8_e4m3fn), ("s8", np.uint8), ("w4", np.uint8)):
        out = Output(name, t[name].shape, np.dtype(dtype), "raw", (name,))
        np.testing.assert_array_equal(produce(out, ckpt, ()).view(np.uint8), t[name])


# ----------------------------------------------------------------------------- the native model path
# XLA:CPU flushes fp32 subnormals to zero, so the model path sees E8M0 bytes from 10 up: an E4M3 value
# (down to 2^-9) times 2^(10-127) stays normal. The converter path above covers the bytes below.


def _scales(rng, shape):
    return special_bytes(rng, shape, [10, 127, 254, 255], low=10)


def test_native_linear_dense_is_the_oracle():
    rng = np.random.default_rng(1)
    lin = Linear(160, 96, "q_down", dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), native=True)
    w, s = special_bytes(rng, (96, 160), [0x80, 0x7E, 0xFE, 0x7F]), _scales(rng, (3, 5))
    lin.weight[...], lin.scale[...] = jnp.asarray(w.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s)
    same(np.asarray(lin.dense(jnp.float32)), oracle_fp8(w, s, 32, 32))


def test_native_experts_dense_is_the_oracle():
    rng = np.random.default_rng(2)
    stack = StackedLinear(3, 128, 48, "expert_up", param_dtype=jnp.float32, rngs=nnx.Rngs(0), native=True)
    packed, s = special_bytes(rng, (3, 48, 64), [0x80, 0x08, 0x77, 0xFF]), _scales(rng, (3, 48, 4))
    stack.weight[...], stack.scale[...] = jnp.asarray(packed), jnp.asarray(s)
    same(np.asarray(stack.dense(jnp.float32)), oracle_fp4(packed, s))


def test_native_engram_lookup_decodes_only_the_gathered_rows():
    rng = np.random.default_rng(3)
    table = Table(70, 64, param_dtype=jnp.float32, rngs=nnx.Rngs(0), native=True)
    w, s = special_bytes(rng, (70, 64), [0x80, 0x7E, 0xFE, 0x7F]), _scales(rng, (70, 2))
    table.weight[...], table.scale[...] = jnp.asarray(w.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s)
    rows = rng.integers(0, 70, (2, 5, 3))
    same(np.asarray(table.lookup(jnp.asarray(rows))), oracle_fp8(w, s, 1, 32)[rows])
