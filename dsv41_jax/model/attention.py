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
from dsv41_jax.model.documents import Documents, Entries, entries, from_document, to_document, visible
from dsv41_jax.model.indexer import Indexer, candidate_blocks, expand_blocks, select_topk
from dsv41_jax.model.indexer_loss import IndexerStats, indexer_stats
from dsv41_jax.model.layers import Linear, RMSNorm
from dsv41_jax.model.rope import apply_rope, rope_frequencies
from dsv41_jax.model.sparse import entry_mass, sparse_attention
from dsv41_jax.sharding import param
from dsv41_jax.topology import LayerSpec


class Shared(NamedTuple):
    """Cross-layer CSA2 state of one forward (spec attention §1.2, §11)."""

    main_kv: Float[Array, "B C H"] | None = None  # post-RoPE, FP4-QDQ'd main KV of the latest KV source
    index_k: Float[Array, "B C I"] | None = None  # MXFP4-QDQ'd index keys of the latest KV source
    topk: Int[Array, "B S K"] | None = None  # selection of the latest index source
    # kept blocks of the candidate source; with documents, block b of a query covers the entries
    # lo + [b·size, (b+1)·size) counted from its document's first entry (dsv41_jax.model.documents)
    candidates: Bool[Array, "B S NB"] | None = None
    indexer: IndexerStats | None = None  # of the index source that just ran, when asked for


class PrefixReuse(NamedTuple):
    """A KV source's global KV from the prefix cache, and each row's hit length (spec §9.4)."""

    main_kv: Float[Array, "B C H"]
    index_k: Float[Array, "B C I"]
    hit: Int[Array, "B"]


def reuse_prefix(shared: Shared, reuse: PrefixReuse, ratio: int) -> Shared:
    """Entries whose group ``[j·m, j·m + m)`` ends before the hit come from the prefix cache (§9.4): the
    replay never rewrites them; a group straddling the hit is written from the replayed rows."""
    kept = ((jnp.arange(reuse.main_kv.shape[1]) + 1) * ratio <= reuse.hit[:, None])[..., None]  # [B, C, 1]
    return shared._replace(main_kv=jnp.where(kept, reuse.main_kv, shared.main_kv),
                           index_k=jnp.where(kept, reuse.index_k, shared.index_k))


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

    def __call__(self, x: Float[Array, "B S D"], shared: Shared, docs: Documents | None = None, *,
                 indexer_target: str | None = None, replay_floor: Int[Array, "B"] | None = None,
                 reuse: PrefixReuse | None = None) -> tuple[Float[Array, "B S D"], Shared]:
        """Training-mode forward over whole rows.

        Without ``docs`` a row is one sequence starting at position 0. With ``docs`` (packed documents,
        :mod:`dsv41_jax.model.documents`) no information crosses a document boundary. With
        ``indexer_target`` (``dense`` | ``topk``) an index source also returns its :class:`IndexerStats`
        in ``shared.indexer`` (:mod:`dsv41_jax.model.indexer_loss`).

        The served path of post-training (:mod:`dsv41_jax.posttrain.replay`) adds, for unpacked rows: a
        ``replay_floor`` per row, where every window starts (the engine's bounded replay; the indexer's dense
        target sees the same truncated window), and on a KV source ``reuse``, the prefix cache's global KV
        that replaces the entries written before the hit (:func:`reuse_prefix`).
        """
        cfg, spec = self.cfg, self.spec
        b, s, _ = x.shape
        if docs is not None and (replay_floor is not None or reuse is not None):
            raise ValueError("Attention: replay_floor and reuse are for unpacked rows (docs=None)")
        pos = jnp.broadcast_to(jnp.arange(s), (b, s)) if docs is None else docs.positions
        floor = None if docs is None else docs.start  # window keys of a query start here
        replay = 0 if replay_floor is None else replay_floor
        if replay_floor is not None:
            floor = jnp.broadcast_to(replay_floor[:, None], (b, s))  # for the indexer's dense target
        q, q_latent = self.query(x, pos)
        window_kv = self.window_kv(x, pos)
        sink = self.attn_sink[...]
        doc_floor = None if docs is None else floor
        if not spec.compressed:
            o = sparse_attention(q, window_kv, sink, cfg.window_size, replay_start=replay, key_floor=doc_floor)
            return self.output(o, pos), shared
        ent = entries(docs, spec.ratio, b, s)
        if spec.owns_compressor:
            shared = self._publish_kv(x, shared, ent)
            if reuse is not None:
                shared = reuse_prefix(shared, reuse, spec.ratio)
        attend = dict(replay_start=replay, key_floor=doc_floor)
        if not (spec.has_indexer and indexer_target):
            if spec.has_indexer:
                shared = self._select(x, q_latent, pos, shared, ent)[0]
            o = sparse_attention(q, window_kv, sink, cfg.window_size, shared.main_kv, shared.topk, **attend)
            return self.output(o, pos), shared
        shared, scores = self._select(x, q_latent, pos, shared, ent)
        o, topk_mass = sparse_attention(q, window_kv, sink, cfg.window_size, shared.main_kv, shared.topk,
                                        return_mass=True, **attend)
        with jax.named_scope("indexer_loss"):
            vis = visible(ent, shared.main_kv.shape[1])
            dense = entry_mass(q, window_kv, sink, cfg.window_size, shared.main_kv, vis, key_floor=floor)
            stats = indexer_stats(indexer_target, scores, vis, dense, shared.topk, topk_mass)
        return self.output(o, pos), shared._replace(indexer=stats)

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

    def _publish_kv(self, x: jax.Array, shared: Shared, ent: Entries) -> Shared:
        """Main KV and index keys from the compressor latent, positioned at each group's first token (§3.4)."""
        with jax.named_scope("compressor"):
            latent = self.compressor(x, ent.first)  # [B, C, H], pre-RoPE
        # the indexer reads the latent before RoPE/QDQ, detached: it learns only from its own loss
        with jax.named_scope("indexer"):
            index_k = self.indexer.keys(jax.lax.stop_gradient(latent), ent.positions, self.freqs)
        main_kv = apply_rope(latent, ent.positions, self.freqs, heads=False)
        main_kv = quant.qdq_nvfp4(main_kv) if self.cfg.cache_quant.main_kv else main_kv
        return shared._replace(main_kv=main_kv, index_k=index_k)

    def _select(self, x: jax.Array, q_latent: jax.Array, pos: jax.Array, shared: Shared, ent: Entries
                ) -> tuple[Shared, jax.Array]:
        """Top-k (and candidates) of an index source; also returns its scores before candidate restriction."""
        with jax.named_scope("indexer"):
            return self._select_scoped(x, q_latent, pos, shared, ent)

    def _select_scoped(self, x, q_latent, pos, shared, ent):
        cfg, spec = self.cfg, self.spec
        x, q_latent = jax.lax.stop_gradient((x, q_latent))  # the indexer is detached (indexer_loss)
        # entry t is visible iff lo ≤ t < hi; hi = (p+1) div m without documents (spec §3.5)
        scores = self.indexer.scores(x, q_latent, pos, self.freqs, shared.index_k, ent.hi, ent.lo)
        restricted, t = scores, scores.shape[-1]
        if spec.candidate_source:
            own = scores if ent.lo is None else to_document(scores, ent.lo, -jnp.inf)
            n_own = ent.hi if ent.lo is None else ent.hi - ent.lo
            blocks = candidate_blocks(own, n_own, cfg.candidate_block_size, cfg.candidate_topk_blocks,
                                      backend=cfg.kernel_backend)
            shared = shared._replace(candidates=blocks)
        if spec.uses_candidates:
            allowed = expand_blocks(shared.candidates, cfg.candidate_block_size, t)
            allowed = allowed if ent.lo is None else from_document(allowed, ent.lo, False)
            restricted = jnp.where(allowed, scores, -jnp.inf)
        return shared._replace(topk=select_topk(restricted, cfg.index_topk, ent.hi, ent.lo)), scores

    def output(self, o: Float[Array, "B S N H"], pos: jax.Array) -> Float[Array, "B S D"]:
        """Inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b`` (spec §3.7)."""
        cfg = self.cfg
        b, s = o.shape[:2]
        o = apply_rope(o, pos, self.freqs, heads=True, inverse=True)
        og = o.reshape(b, s, cfg.o_groups, -1)  # group g = heads [g·N/G, (g+1)·N/G)
        wo_a = self.wo_a.weight[...].astype(o.dtype).reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        u = jnp.einsum("bsgi,gri->bsgr", og, wo_a, preferred_element_type=jnp.float32).astype(o.dtype)
        return self.wo_b(u.reshape(b, s, -1))
