"""Flax NNX modules of the DeepSeek-V4.1-Flash backbone."""

from dsv41_jax.model.attention import Attention, Shared
from dsv41_jax.model.transformer import Aux, Block, Transformer

__all__ = ["Attention", "Aux", "Block", "Shared", "Transformer"]
