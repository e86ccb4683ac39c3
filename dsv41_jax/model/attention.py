"""One CSA2 attention layer in every role: SWA, Full, Reindex, Reuse (spec attention §3).

Every layer computes its own query and its own SWA KV. Main KV and index keys come from the latest KV
source, top-k from the latest index source, the candidate pool from the candidate source; they flow
between layers in :class:`Shared`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import AttentionConfig
from dsv41_jax.model.compressor import Compressor
from dsv41_jax.model.indexer import Indexer, candidate_blocks, expand_blocks, select_topk
from dsv41_jax.model.layers import Linear, RMSNorm
from dsv41_jax.model.rope import apply_rope, rope_frequencies
from dsv41_jax.model.sparse import sparse_attention
from dsv41_jax.sharding import param
from dsv41_jax.topology import LayerSpec


class Shared(NamedTuple):
    """Cross-layer CSA2 state of one forward (spec attention §1.2, §11)."""

    main_kv: Float[Array, "B C H"] | None = None  # post-RoPE, FP4-QDQ'd main KV of the latest KV source
    index_k: Float[Array, "B C I"] | None = None  # MXFP4-QDQ'd index keys of the latest KV source
    topk: Int[Array, "B S K"] | None = None  # selection of the latest index source
    candidates: Bool[Array, "B S NB"] | None = None  # kept blocks of the candidate source


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, spec: LayerSpec, dim: int, norm_eps: float, *, dtype, param_dtype,
                 rngs: nnx.Rngs, native: bool = False):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        fp8 = kw | dict(native=native)  # the FP8 linears of the release (spec model §2.3)
        n, h = cfg.n_heads, cfg.head_dim
        self.wq_a = Linear(dim, cfg.q_lora_rank, "q_down", **fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, norm_eps, param_dtype=param_dtype)
        self.wq_b = Linear(cfg.q_lora_rank, n * h, "q_up", **fp8)
        self.wkv = Linear(dim, h, "kv_down", **fp8)
        self.kv_norm = RMSNorm(h, norm_eps, param_dtype=param_dtype)
        # wo_a is block-diagonal over o_groups groups of n/o_groups contiguous heads (spec §3.7); stored FP8,
        # but held dequantised even in native mode, as the reference does at load (spec model §2.5)
        self.wo_a = Linear(n // cfg.o_groups * h, cfg.o_groups * cfg.o_lora_rank, "out_group", **kw)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, dim, "out_proj", **fp8)
        self.attn_sink = param("sink", jnp.zeros((n,), jnp.float32))
        if spec.owns_compressor:
            self.compressor = Compressor(dim, h, spec.ratio, norm_eps, **kw)
        if spec.has_indexer:
            self.indexer = Indexer(cfg, dim, norm_eps, owns_keys=spec.owns_compressor, **fp8)
        self.cfg, self.spec = cfg, spec

    @property
    def freqs(self):
        return rope_frequencies(self.cfg, self.spec.rope)

    def __call__(self, x: Float[Array, "B S D"], shared: Shared) -> tuple[Float[Array, "B S D"], Shared]:
        """Training-mode forward over a whole sequence starting at position 0."""
        cfg, spec = self.cfg, self.spec
        b, s, _ = x.shape
        pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        q, q_latent = self.query(x, pos)
        window_kv = self.window_kv(x, pos)
        if spec.owns_compressor:
            shared = self._publish_kv(x, shared)
        if spec.has_indexer:
            shared = self._select(x, q_latent, pos, shared)
        if spec.compressed:
            o = sparse_attention(q, window_kv, self.attn_sink[...], cfg.window_size, shared.main_kv, shared.topk)
        else:
            o = sparse_attention(q, window_kv, self.attn_sink[...], cfg.window_size)
        return self.output(o, pos), shared

    def query(self, x: Float[Array, "B S D"], pos: Int[Array, "B S"]):
        """``(q [B,S,N,H] with RoPE on the trailing lanes, q_latent [B,S,R])`` (spec §3.1)."""
        cfg = self.cfg
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).reshape(*x.shape[:2], cfg.n_heads, cfg.head_dim)
        return apply_rope(q, pos, self.freqs, heads=True), q_latent

    def window_kv(self, x: Float[Array, "B S D"], pos: Int[Array, "B S"]) -> Float[Array, "B S H"]:
        """This layer's own SWA KV: RoPE, then FP8 fake-quant over all lanes (spec §3.2, §7.1)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), pos, self.freqs, heads=False)
        return quant.qdq_fp8_ue8m0(kv) if self.cfg.cache_quant.swa else kv

    def _publish_kv(self, x: jax.Array, shared: Shared) -> Shared:
        """Main KV and index keys from the compressor latent, positioned at each group's first token (§3.4)."""
        latent = self.compressor(x)  # [B, C, H], pre-RoPE
        cpos = jnp.broadcast_to(jnp.arange(latent.shape[1]) * self.spec.ratio, latent.shape[:2])
        index_k = self.indexer.keys(latent, cpos, self.freqs)  # the indexer reads the latent before RoPE/QDQ
        main_kv = apply_rope(latent, cpos, self.freqs, heads=False)
        main_kv = quant.qdq_nvfp4(main_kv) if self.cfg.cache_quant.main_kv else main_kv
        return shared._replace(main_kv=main_kv, index_k=index_k)

    def _select(self, x: jax.Array, q_latent: jax.Array, pos: jax.Array, shared: Shared) -> Shared:
        cfg, spec = self.cfg, self.spec
        n_visible = (pos + 1) // spec.ratio  # t visible iff t < (p+1) div m (spec §3.5)
        scores = self.indexer.scores(x, q_latent, pos, self.freqs, shared.index_k, n_visible)
        if spec.candidate_source:
            blocks = candidate_blocks(scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            shared = shared._replace(candidates=blocks)
        if spec.uses_candidates:
            allowed = expand_blocks(shared.candidates, cfg.candidate_block_size, scores.shape[-1])
            scores = jnp.where(allowed, scores, -jnp.inf)
        return shared._replace(topk=select_topk(scores, cfg.index_topk, n_visible))

    def output(self, o: Float[Array, "B S N H"], pos: jax.Array) -> Float[Array, "B S D"]:
        """Inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b`` (spec §3.7)."""
        cfg = self.cfg
        b, s = o.shape[:2]
        o = apply_rope(o, pos, self.freqs, heads=True, inverse=True)
        og = o.reshape(b, s, cfg.o_groups, -1)  # group g = heads [g·N/G, (g+1)·N/G)
        wo_a = self.wo_a.weight[...].astype(o.dtype).reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        u = jnp.einsum("bsgi,gri->bsgr", og, wo_a, preferred_element_type=jnp.float32).astype(o.dtype)
        return self.wo_b(u.reshape(b, s, -1))
