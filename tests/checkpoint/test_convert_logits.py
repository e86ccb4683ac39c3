"""The three weights modes give the same model: native (FP8 / FP4 dequantised on the fly) vs bf16 vs fp32.

Stated bound: under the same runtime precision (fp32 activations) the logits of the three conversions agree
to a row relative L2 of 1e-6 (we observe 0: bit-identical). The reason is exactness, not luck: an E4M3 or
E2M1 value times a power of two is exact in fp32 and in bf16 (spec model §2.2), so all three hold the same
weight values, and F32 tensors stay F32 in every mode. A bf16 *runtime* is a different computation; its
spread is bounded in tests/model/test_golden.py.

The model is a 4-layer variant of the tiny config that keeps every layer role (SWA, ratio-2 KV source,
ratio-1 candidate source, reindexing consumer), Engram and the shared expert, to compile in seconds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.fake_hf import write_fake_hf
from dsv41_jax.checkpoint.load import model_from_orbax
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.scoring import row_rel_l2

BOUND = 1e-6


def micro() -> C.ModelConfig:
    t = C.tiny()
    attention = dataclasses.replace(t.attention, compress_ratios=(0, 2, 1, 1, 0, 0, 0), kv_source_layers=(1, 2),
                                    index_source_layers=(1, 2, 3), candidate_source_layer=2)
    return t.replace(n_layers=4, attention=attention, engram=dataclasses.replace(t.engram, layer_ids=(0, 3)),
                     dspark=dataclasses.replace(t.dspark, target_layer_ids=(1, 2, 3)))


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens, rows):
    return nnx.merge(graphdef, state)(tokens, rows)


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    write_fake_hf(micro(), root / "hf", seed=1, shard_bytes=1 << 20)
    ids = np.random.default_rng(0).integers(0, 512, (2, 48))
    out = {}
    for mode, param_dtype in (("fp32", "float32"), ("bf16", "float32"), ("native", "float32")):
        if not (root / mode).exists():
            convert(root / "hf", root / mode, weights=mode, progress=False)
        model, hasher = model_from_orbax(root / mode, dtype="float32", param_dtype=param_dtype)
        rows, _ = hasher.row_ids(ids)
        graphdef, state = nnx.split(model)
        out[mode, param_dtype] = np.asarray(_logits(graphdef, state, ids, rows.astype(np.int32)))
    return out


def test_native_model_holds_fp8_and_fp4():
    model = abstract_model(micro().replace(weight_format="native"))
    assert model.layers[0].attn.wq_a.weight.dtype == np.dtype("float8_e4m3fn")
    assert model.layers[0].ffn.experts.w1.weight.dtype == np.uint8
    assert model.layers[0].engram.embed.weight.dtype == np.dtype("float8_e4m3fn")


@pytest.mark.parametrize("mode", [("bf16", "float32"), ("native", "float32")])
def test_same_logits_in_every_weights_mode(logits, mode):
    ref, got = logits["fp32", "float32"], logits[mode]
    assert np.isfinite(ref).all() and ref.std() > 0.1  # a live model, not a degenerate one
    err = row_rel_l2(got, ref).max()
    print(f"{mode}: max row rel L2 {err:.2e}, bitwise equal {np.array_equal(got, ref)}")
    assert err <= BOUND
    assert (got.argmax(-1) == ref.argmax(-1)).all()
