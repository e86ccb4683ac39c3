"""Fixtures of the post-training tests: the six-layer model (``posttrain_testing.mini_config``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from posttrain_testing import mini_config

from dsv41_jax.model.transformer import Transformer


@pytest.fixture(scope="session")
def mini_cfg():
    return mini_config()


@pytest.fixture(scope="session")
def mini_model(mini_cfg) -> Transformer:
    """Random weights with non-trivial sinks and router biases."""
    model = Transformer(mini_cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for block in model.layers:
        block.attn.attn_sink[...] = jnp.asarray(rng.normal(size=block.attn.attn_sink.shape), jnp.float32)
        block.ffn.gate.bias[...] = jnp.asarray(rng.normal(size=block.ffn.gate.bias.shape) * 0.1, jnp.float32)
    return model
