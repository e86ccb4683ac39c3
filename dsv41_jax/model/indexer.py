"""Lightning indexer, hierarchical candidate pool and top-k selection (spec attention §3.5, §6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import AttentionConfig
from dsv41_jax.model.layers import Linear, RMSNorm, mixed_einsum
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.sharding import batch_local
from pallas_kernels.block_max import api as block_max_api


class Indexer(nnx.Module):
    """Index queries (every index source) and, on KV sources, the index-key projection ``wk``/``k_norm``."""

    def __init__(self, cfg: AttentionConfig, dim: int, norm_eps: float, owns_keys: bool, *, dtype, param_dtype,
                 rngs: nnx.Rngs, native: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # only wq_b is FP8 in the release; wk and weights_proj are bf16 (spec model §2.3)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, "index_q_up", **kw,
                           native=native)
        self.weights_proj = Linear(dim, cfg.index_n_heads, "index_weights", **kw)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "index_k", **kw)
            self.k_norm = RMSNorm(cfg.index_head_dim, norm_eps, param_dtype=param_dtype)
        self.cfg = cfg

    def keys(self, latent: Float[Array, "B C H"], positions: Int[Array, "B C"], freqs) -> Float[Array, "B C I"]:
        """Index keys from the pre-RoPE compressor latent: RoPE at the group's first position, MXFP4 QDQ."""
        k = apply_rope(self.k_norm(self.wk(latent)), positions, freqs, heads=False)
        return quant.qdq_mxfp4(k) if self.cfg.cache_quant.index else k

    def queries(self, x: Float[Array, "B S D"], q_latent: Float[Array, "B S R"], positions: Int[Array, "B S"],
                freqs) -> tuple[Float[Array, "B S N I"], Float[Array, "B S N"]]:
        """MXFP4-QDQ'd index queries and the per-head weights ``weights_proj(x)/sqrt(I·N)`` (fp32)."""
        c = self.cfg
        iq = self.wq_b(q_latent).reshape(*q_latent.shape[:-1], c.index_n_heads, c.index_head_dim)
        iq = apply_rope(iq, positions, freqs, heads=True)
        iq = quant.qdq_mxfp4(iq) if c.cache_quant.index else iq
        w = self.weights_proj(x).astype(jnp.float32) * (c.index_head_dim * c.index_n_heads) ** -0.5
        return iq, w


def visible_scores(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], lo: Int[Array, "B S"] | None = None
                   ) -> Float[Array, "B S T"]:
    """``scores`` where ``lo ≤ t < n_visible`` (``lo`` default 0), −∞ elsewhere."""
    t = jnp.arange(scores.shape[-1])
    visible = t < n_visible[..., None]
    if lo is not None:
        visible = visible & (t >= lo[..., None])
    return jnp.where(visible, scores, -jnp.inf)


def index_scores(iq: Float[Array, "B S N I"], w: Float[Array, "B S N"], keys: Float[Array, "B T I"]
                 ) -> Float[Array, "B S T"]:
    """``Σ_h w_h·ReLU(q_h·k_t)`` for every key (spec attention §3.5), fp32."""
    dots = mixed_einsum("bsni,bti->bsnt", iq, keys.astype(iq.dtype))
    return jnp.einsum("bsn,bsnt->bst", w, jax.nn.relu(dots))


def gathered_index_scores(iq: Float[Array, "B S N I"], w: Float[Array, "B S N"], keys: Float[Array, "B S K I"]
                          ) -> Float[Array, "B S K"]:
    """The same score against a per-query set of keys (Reindex layers scoring only their candidates)."""
    dots = mixed_einsum("bsni,bski->bsnk", iq, keys.astype(iq.dtype))
    return jnp.einsum("bsn,bsnk->bsk", w, jax.nn.relu(dots))


def candidate_block_ids(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], block_size: int,
                        n_blocks: int, *, backend: str = "xla") -> Int[Array, "B S K"]:
    """Per query, the kept blocks of ``block_size`` positions, ascending, −1 padded (spec attention §6.1).

    Block score = max over its positions; the block holding the newest visible entry is pinned (+∞);
    the top ``n_blocks`` blocks whose score is > −∞ are kept. Ties go to the lower block index. The pass
    over the scores is the ``block_max`` kernel for ``backend="pallas"`` (``attention.kernel_backend``).
    """
    # per device on its own rows: top_k (and a pallas_call) would otherwise run on the gathered batch
    return batch_local(lambda sc, n: block_max_api.candidate_block_ids(sc, n, block_size, n_blocks, backend=backend),
                       scores, n_visible)


def block_mask(ids: Int[Array, "B S K"], n_blocks_total: int) -> Bool[Array, "B S NB"]:
    """Kept-block ids → a per-block bool mask (−1 entries ignored)."""
    ids = jnp.where(ids >= 0, ids, n_blocks_total)  # out of range: dropped by the scatter (−1 would wrap)
    scatter = jax.vmap(jax.vmap(lambda i: jnp.zeros((n_blocks_total,), bool).at[i].set(True, mode="drop")))
    return scatter(ids)


def expand_blocks(blocks: Bool[Array, "B S NB"], block_size: int, length: int) -> Bool[Array, "B S T"]:
    return jnp.repeat(blocks, block_size, axis=-1)[..., :length]


def select_topk(scores: Float[Array, "B S T"], k: int, n_visible: Int[Array, "B S"],
                lo: Int[Array, "B S"] | None = None, *, radix: bool = False, backend: str = "xla"
                ) -> Int[Array, "B S K"]:
    """The ``min(k, T)`` best positions, ascending; picks outside ``[lo, n_visible)`` become −1 (spec §3.5).

    ``lo`` (default 0) is the first entry of the query's document: another document's entry is never kept,
    even as a −∞ filler. ``radix`` finds the same picks with the candidate selection's sort-free radix select
    (``block_max.select_blocks``; its threshold passes as kernels with ``backend="pallas"`` on GPU), for scores
    that are −∞ exactly where an entry is not visible (no ``lo``, no candidate restriction): it drops −∞
    entries where ``top_k`` would keep them as fillers, which this function turns into −1 anyway.
    """
    if radix:
        if lo is not None or k > scores.shape[-1]:
            raise ValueError("select_topk: the radix select takes rows without documents and k <= T")
        # ascending, −1 padded; per device on its own rows, as top_k below
        idx = batch_local(lambda v: block_max_api.select_blocks(v, k, selection="radix", backend=backend), scores)
        return jnp.where(idx < n_visible[..., None], idx, -1).astype(jnp.int32)
    idx = batch_local(lambda v: jax.lax.top_k(v, min(k, v.shape[-1]))[1], scores)
    idx = jnp.sort(idx, axis=-1)
    keep = idx < n_visible[..., None]
    if lo is not None:
        keep = keep & (idx >= lo[..., None])
    return jnp.where(keep, idx, -1).astype(jnp.int32)
