"""Helpers of the post-training tests: a six-layer variant of the tiny config and random Engram row ids.

Layer 0 pure SWA, 1 ratio-2 Full (KV source, Engram), 2 ratio-2 Full two layers up (so a ratio-2 group that
straddles a hit is written from replayed rows that differ from the exact ones), 3 ratio-1 Full (candidate
source; the engines' CED cut is 4), 4 Reindex and 5 Reuse in the decoder. Window 8, top-k 16 and a 29-entry
candidate pool all bind within the 56-token rows of these tests.
"""

from __future__ import annotations

import numpy as np

from dsv41_jax import config as C


def mini_model_dict() -> dict:
    """The six-layer variant as the ``model:`` section of a run config."""
    return {"preset": "tiny", "dtype": "float32", "n_layers": 6,
            "attention": {"compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0], "kv_source_layers": [1, 2, 3],
                          "index_source_layers": [1, 2, 3, 4], "candidate_source_layer": 3},
            "engram": {"layer_ids": [1], "num_embeddings": [434]}, "dspark": {"target_layer_ids": [3, 4, 5]}}


def small_model_dict() -> dict:
    """Four layers (SWA, ratio-2 Full with Engram, ratio-1 candidate source, Reindex) for training tests."""
    return {"preset": "tiny", "dtype": "float32", "n_layers": 4,
            "attention": {"compress_ratios": [0, 2, 1, 1, 0, 0, 0], "kv_source_layers": [1, 2],
                          "index_source_layers": [1, 2, 3], "candidate_source_layer": 2},
            "engram": {"layer_ids": [1], "num_embeddings": [434]}, "dspark": {"target_layer_ids": [1, 2, 3]}}


def mini_config() -> C.ModelConfig:
    return C.from_dict(mini_model_dict())


def random_rows(cfg: C.ModelConfig, tokens: np.ndarray, seed: int = 0) -> np.ndarray:
    """Engram row ids [B, S, n_layers, C] (any in-range ids: the served path treats them per token)."""
    rng = np.random.default_rng(seed)
    b, s = tokens.shape
    return np.stack([rng.integers(0, n, (b, s, cfg.engram.n_columns)) for n in cfg.engram.num_embeddings],
                    axis=2).astype(np.int32)


HITS = np.array([8, 11, 12, 13, 15, 16, 17, 24, 25, 0])  # 0: cold prefill
PROMPT, LENGTH, PAD = 40, 56, 64


def conversation_batch(cfg: C.ModelConfig, seed: int = 5):
    """One random conversation (prompt 40, response 16 tokens, padded to 64), once per entry of HITS."""
    from dsv41_jax.posttrain.evaluate import EvalBatch

    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(HITS), PAD), np.int32)
    tokens[:, :LENGTH] = rng.integers(4, cfg.vocab_size, LENGTH)
    return EvalBatch(tokens, random_rows(cfg, tokens), np.full(len(HITS), PROMPT, np.int32),
                     np.full(len(HITS), LENGTH, np.int32))


def two_layer_model_dict(**attention) -> dict:
    """Two layers, both index sources (ratio 2, then ratio 1 restricted to the candidates), no Engram: the
    smallest post-training step to compile. ``attention`` overrides keys of that section."""
    return {"preset": "tiny", "dtype": "float32", "n_layers": 2,
            "attention": {"compress_ratios": [2, 1, 0, 0, 0], "kv_source_layers": [0, 1],
                          "index_source_layers": [0, 1], "candidate_source_layer": 1, **attention},
            "engram": {"layer_ids": [], "num_embeddings": []}, "dspark": {"target_layer_ids": [0, 1, 1]}}


def record_grads():
    """An optax transform that keeps the step's gradient as its state (and applies it unscaled)."""
    import jax
    import jax.numpy as jnp
    import optax

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, _, p=None: (g, g))


def sft_rows(cfg: C.ModelConfig, prompts, lengths, seq: int, loss_from=None, seed: int = 3) -> dict:
    """One micro-batch [1, B, S] of SFT rows: random tokens, prompt lengths, and a loss mask over the response
    (from ``loss_from`` instead of each prompt's end, when given)."""
    rng = np.random.default_rng(seed)
    prompts, lengths = np.asarray(prompts), np.asarray(lengths)
    seg = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    tokens = (rng.integers(4, cfg.vocab_size, (len(lengths), seq)) * seg).astype(np.int32)
    pos = np.arange(seq)[None]
    start = prompts[:, None] - 1 if loss_from is None else loss_from
    mask = ((pos >= start) & (pos < lengths[:, None] - 1)).astype(np.float32)
    rows = dict(tokens=tokens, segment_ids=seg, prompt_len=prompts.astype(np.int32), loss_mask=mask)
    return {k: v[None] for k, v in rows.items()}
