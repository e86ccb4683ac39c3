"""The compiled generation loop: greedy decode reproduces the reference; samplers; prompt validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.checkpoint.load import model_from_hf
from dsv41_jax.engine.sampling import Generator, SamplingConfig, sample_logits
from dsv41_jax.engram_device import device_engram


@pytest.fixture(scope="module")
def golden_generator(golden_dir):
    model, hasher = model_from_hf(golden_dir / "tiny_hf")
    sampling = SamplingConfig(temperature=0, max_new_tokens=8, stop_tokens=(), block=4, prefill_chunk=64)
    return Generator(model, device_engram(hasher), 2, 256, sampling), model, hasher


def test_greedy_generation_reproduces_the_reference(golden_generator, golden_dir):
    """Chunked prefill (64+64+32 ragged-capable chunks) then 8 greedy steps in compiled blocks: the same tokens
    the reference decoded greedily (its decode inputs are the previous argmaxes)."""
    gen, _, _ = golden_generator
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ref = np.load(golden_dir / "ref_fp32.npz")
    want = np.concatenate([ref["batch2_decode_input_ids"], ref["batch2_decode_next_ids"][:, -1:]], axis=1)[:, :8]
    np.testing.assert_array_equal(np.array(gen.generate([list(r) for r in ids])), want)


def test_prompt_validation(golden_generator):
    gen, _, _ = golden_generator
    with pytest.raises(ValueError, match="empty"):
        gen.prefill([[0, 5], []])
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.prefill([[0] * 300, [0]])
    with pytest.raises(ValueError, match="outside"):
        gen.prefill([[0, 512], [0]])
    with pytest.raises(ValueError, match="batch"):
        gen.prefill([[0]])


def test_samplers():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(1), 4)
    greedy = sample_logits(logits, keys, SamplingConfig(temperature=0))
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), -1))
    np.testing.assert_array_equal(sample_logits(logits, keys, SamplingConfig(temperature=1.0, top_k=1)), greedy)
    np.testing.assert_array_equal(sample_logits(logits, keys, SamplingConfig(temperature=1.0, top_p=1e-6)), greedy)
    # top-k: over many keys every draw lies in the top 3; a fixed key is reproducible, another key differs
    many = jax.vmap(lambda k: sample_logits(logits, jax.random.split(k, 4), SamplingConfig(top_k=3)))(
        jax.random.split(jax.random.key(2), 200))
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    assert all(np.isin(np.asarray(many)[:, i], top3[i]).all() for i in range(4))
    assert len({tuple(r) for r in np.asarray(many).tolist()}) > 1
    # top-p: draws stay inside the smallest prefix whose probability reaches p
    p = 0.5
    probs = np.asarray(jax.nn.softmax(logits, -1))
    many = np.asarray(jax.vmap(lambda k: sample_logits(logits, jax.random.split(k, 4), SamplingConfig(top_p=p)))(
        jax.random.split(jax.random.key(3), 200)))
    for i in range(4):
        order = np.argsort(-probs[i])
        n = int(np.searchsorted(np.cumsum(probs[i][order]), p) + 1)
        assert np.isin(many[:, i], order[:n]).all()


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_chunked_ced_prefill_equals_one_chunk_ced(golden_generator, golden_dir):
    """Generation with CED prefill in 64-token chunks (layers after the cut skipped on non-final chunks,
    prompts right-aligned so each ends in the final chunk) gives the one-chunk CED prefill's logits."""
    import jax.numpy as jnp

    from dsv41_jax import cache as C
    from dsv41_jax.engine import ChunkOptions, default_ced_cut, forward_chunk

    _, model, hasher = golden_generator
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"][:, :150]
    prompts = [list(ids[0]), list(ids[1, :131])]  # ragged: 150 and 131 tokens
    sampling = SamplingConfig(temperature=0, max_new_tokens=1, stop_tokens=(), block=1, prefill_chunk=64,
                              prefill_mode="ced")
    state = Generator(model, device_engram(hasher), 2, 256, sampling).prefill(prompts)
    padded = np.zeros((2, 150), np.int64)
    padded[0], padded[1, :131] = ids[0], ids[1, :131]
    rows, _ = hasher.row_ids(padded, None)
    cut = default_ced_cut(model.cfg)
    want, _ = forward_chunk(model, C.init_cache(model.cfg, 2, 256), jnp.asarray(padded), jnp.asarray(rows, jnp.int32),
                            jnp.array([150, 131]), options=ChunkOptions(ced_cut=cut))
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [150, 131])
