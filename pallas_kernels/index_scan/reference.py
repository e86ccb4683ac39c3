"""The XLA index scan over packed MXFP4 keys: unpack every key to the queries' dtype, then the model's score."""

from __future__ import annotations

from jaxtyping import Array, Float, UInt8

from dsv41_jax import quant
from dsv41_jax.model.indexer import index_scores as dense_index_scores


def index_scores(iq: Float[Array, "B S N I"], w: Float[Array, "B S N"], codes: UInt8[Array, "B T P"],
                 exps: UInt8[Array, "B T G"]) -> Float[Array, "B S T"]:
    """``Σ_h w[s, h]·ReLU(q[s, h]·k[t])`` for every entry ``t`` of the cache (fp32, nothing masked)."""
    return dense_index_scores(iq, w, quant.unpack_mxfp4(codes, exps, iq.dtype))
