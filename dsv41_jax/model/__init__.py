"""Flax NNX modules of the DeepSeek-V4.1-Flash backbone."""

from dsv41_jax.model.attention import Attention, Shared
from dsv41_jax.model.kv_store import DenseKV, KVStore, PrefixReuse, Visibility
from dsv41_jax.model.transformer import Aux, Block, Schedule, Trace, Transformer

__all__ = ["Attention", "Aux", "Block", "DenseKV", "KVStore", "PrefixReuse", "Schedule", "Shared", "Trace",
           "Transformer", "Visibility"]
