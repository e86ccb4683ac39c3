"""Build our model from a release-format Hugging Face directory (dequantised weights)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.hf import load_hf_params
from dsv41_jax.checkpoint.tree import NON_BACKBONE_PREFIXES, assign
from dsv41_jax.engram_hash import EngramHasher, build_token_map, check_token_map
from dsv41_jax.model.transformer import Transformer, abstract_model


def model_from_hf(hf_dir: str | os.PathLike, *, dtype: str = "float32", param_dtype: str = "float32"
                  ) -> tuple[Transformer, EngramHasher]:
    """The text backbone with the checkpoint's weights, and the Engram hasher of its ``tokenizer.json``."""
    hf_dir = Path(hf_dir)
    cfg = C.from_hf(hf_dir).replace(dtype=dtype, param_dtype=param_dtype)
    model = abstract_model(cfg)
    arrays = load_hf_params(hf_dir, include=lambda name: not name.startswith(NON_BACKBONE_PREFIXES))
    for var in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        var.set_value(np.zeros(var.shape, var.dtype))  # concrete placeholders, overwritten by assign
    assign(model, arrays)
    token_map = build_token_map(hf_dir / "tokenizer.json")
    check_token_map(token_map, cfg.engram)
    return model, EngramHasher(cfg.engram, token_map)
