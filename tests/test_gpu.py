"""Accelerator checks (run on the device machine with the same pytest command; skipped on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("qdq, pack, unpack", [
    (quant.qdq_fp8_ue8m0, quant.pack_fp8_ue8m0, quant.unpack_fp8_ue8m0),
    (quant.qdq_nvfp4, quant.pack_nvfp4, quant.unpack_nvfp4),
    (quant.qdq_mxfp4, quant.pack_mxfp4, quant.unpack_mxfp4),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fake_quant_really_rounds_inside_one_jit(qdq, pack, unpack, dtype):
    """XLA:GPU removes cast round trips inside a jit (notes/PLATFORM.md): our QDQ must still round, and
    equal the storage path computed on the CPU."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 512)) * 3, dtype)
    fused = jax.jit(lambda v: qdq(v * 1 + 0) * 1)(x)
    assert float(jnp.abs(fused.astype(jnp.float32) - x.astype(jnp.float32)).max()) > 0
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        xc = jax.device_put(np.asarray(x), cpu)
        want = np.asarray(unpack(*pack(xc.astype(jnp.float32)), jnp.float32))
    np.testing.assert_array_equal(np.asarray(fused.astype(jnp.float32)), want)


def _on_backend(model, backend: str):
    """The same weights with ``attention.kernel_backend: backend``."""
    import dataclasses

    from flax import nnx

    from dsv41_jax.model import Transformer

    if model.cfg.attention.kernel_backend == backend:
        return model
    cfg = model.cfg.replace(attention=dataclasses.replace(model.cfg.attention, kernel_backend=backend))
    other = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model))
    return other


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_golden_prefill_on_gpu(golden_dir, backend):
    """The golden fp32 prefill on the accelerator (matmul precision 'highest'): the robust recipe holds, on
    either kernel backend (fp32 activations take the XLA attention; the cache pack and block-max kernels run)."""
    from dsv41_jax.checkpoint.load import model_from_hf
    from dsv41_jax.scoring import prefill_outputs, row_rel_l2

    with jax.default_matmul_precision("highest"):
        model, hasher = model_from_hf(golden_dir / "tiny_hf")
        ids = np.load(golden_dir / "inputs.npz")["batch1_ids"]
        ours = prefill_outputs(_on_backend(model, backend), hasher, ids, "batch1")
    ref = np.load(golden_dir / "ref_fp32.npz")
    err = row_rel_l2(ours["batch1_prefill_logits"], ref["batch1_prefill_logits"])
    assert np.median(err) < 1e-4 and np.quantile(err, 0.9) < 1e-2
    for layer in (2, 4, 6, 8, 10):
        agree = (np.sort(ours[f"batch1_topk_{layer}"], -1) == np.sort(ref[f"batch1_topk_{layer}"], -1)).all(-1)
        assert agree.mean() > 0.75


def test_golden_bf16_prefill_with_the_attention_kernel_on_gpu(golden_dir):
    """bf16 activations with ``kernel_backend: pallas`` (the Mosaic attention kernel takes 16-bit queries): the
    golden logits sit inside the reference's own bf16 spread (README §7: its native run against its fp32 run,
    median row error 0.26, argmax agreement 0.64), against both references, as the CPU's bf16 test holds XLA."""
    from dsv41_jax.checkpoint.load import model_from_hf
    from dsv41_jax.scoring import prefill_outputs, row_rel_l2
    from pallas_kernels.sparse_attention import api

    model, hasher = model_from_hf(golden_dir / "tiny_hf", dtype="bfloat16")
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ours = prefill_outputs(_on_backend(model, "pallas"), hasher, ids, "batch2")["batch2_prefill_logits"]
    q = jnp.zeros((*ids.shape, model.cfg.attention.n_heads, model.cfg.attention.head_dim), jnp.bfloat16)
    assert api.kernel_applies(q)  # the kernel, not the XLA fallback, ran the attention
    for ref_file in ("ref_fp32.npz", "ref_native.npz"):
        ref = np.load(golden_dir / ref_file)["batch2_prefill_logits"]
        err = row_rel_l2(ours, ref)
        assert np.median(err) < 0.3 and (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.6, (ref_file, np.median(err))


def test_fp32_head_of_a_bf16_weight_on_gpu(rng):
    """The head on the GPU, by default (from 4 rows three bf16 terms of x in one bf16 matmul) and split at every
    row count: within fp32 rounding of the exact product, so XLA kept the terms' ``reduce_precision``
    roundings."""
    from dsv41_jax.model.layers import fp32_head

    d, v = 2048, 4096
    for rows in (1, 32):
        x = (rng.standard_normal((rows, 1, d)) * np.exp(rng.uniform(-4, 4, (rows, 1, 1)))).astype(np.float32)
        w = jnp.asarray(rng.standard_normal((v, d)) * d ** -0.5, jnp.bfloat16)
        exact = np.einsum("bsd,vd->bsv", x.astype(np.float64), np.asarray(w, np.float64))
        for split in (None, True):  # the default (by rows) and the split form at every row count
            got = np.asarray(jax.jit(lambda x, w, s=split: fp32_head(x, w, split=s))(jnp.asarray(x), w), np.float64)
            rel = np.linalg.norm(got - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
            assert rel.max() < 1e-6, (rows, split, rel.max())
