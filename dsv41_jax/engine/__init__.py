"""Inference: prefill (exact / CED), bounded replay, decode and sampling over packed caches."""

from dsv41_jax.engine.prefill import default_ced_cut, prefill, replay_after_hit
from dsv41_jax.engine.step import ChunkOptions, decode_step, forward_chunk

__all__ = ["ChunkOptions", "decode_step", "default_ced_cut", "forward_chunk", "prefill", "replay_after_hit"]
