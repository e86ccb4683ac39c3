"""One CSA2 attention layer in every role: SWA, Full, Reindex, Reuse (spec attention §3).

Every layer computes its own query and its own SWA KV. Main KV and index keys come from the latest KV
source, top-k from the latest index source, the candidate pool from the candidate source; they flow
between layers in :class:`Shared`. The keys live in a store (:mod:`dsv41_jax.model.kv_store`): tensors of a
full-sequence forward in training and scoring, the packed cache in the engine. The role dispatch, the
indexer, the candidate pool and top-k are decided here, once, whatever the store.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import AttentionConfig
from dsv41_jax.model.compressor import Compressor
from dsv41_jax.model.documents import from_document, to_document, visible
from dsv41_jax.model.indexer import (
    Indexer,
    block_mask,
    candidate_block_ids,
    expand_blocks,
    gathered_index_scores,
    select_topk,
    visible_scores,
)
from dsv41_jax.model.indexer_loss import IndexerStats, indexer_stats
from dsv41_jax.model.kv_store import KVStore, Visibility
from dsv41_jax.model.layers import Linear, RMSNorm, mixed_einsum
from dsv41_jax.model.rope import apply_rope, rope_frequencies
from dsv41_jax.model.sparse import entry_mass
from dsv41_jax.sharding import batch_local, param
from dsv41_jax.topology import LayerSpec
from pallas_kernels import index_scan
from pallas_kernels.sparse_attention import api as sparse_api

# entries from which a decode step's top-k over a full scan takes the radix select (None: always top_k)
RADIX_TOPK_MIN_ENTRIES: int | None = None


class Shared(NamedTuple):
    """Cross-layer CSA2 state of one forward (spec attention §1.2, §11): the keys, and the selections that flow
    from index sources to the layers after them."""

    kv: KVStore  # main KV and index keys of the KV sources (and, in the engine, every layer's SWA ring)
    topk: Int[Array, "B S K"] | None = None  # selection of the latest index source (entries, ascending, −1)
    # kept blocks of the candidate source, ascending, −1 padded; with documents, block b of a query covers the
    # entries lo + [b·size, (b+1)·size) counted from its document's first entry (dsv41_jax.model.documents)
    candidates: Int[Array, "B S NB"] | None = None
    indexer: IndexerStats | None = None  # of the index source that just ran, when asked for


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

    def __call__(self, x: Float[Array, "B S D"], shared: Shared, vis: Visibility | None = None, *,
                 indexer_target: str | None = None, publish: bool = True) -> tuple[Float[Array, "B S D"], Shared]:
        """This layer over the rows of ``x``, reading and writing keys through ``shared.kv``.

        ``vis`` (default: one sequence from position 0) says which keys each row may see. With
        ``indexer_target`` (``dense`` | ``topk``) an index source also returns its :class:`IndexerStats` in
        ``shared.indexer`` (:mod:`dsv41_jax.model.indexer_loss`). ``publish=False``: a KV source's entries
        were already written from every row (:meth:`publish`; CED narrowing at the paper's cut).
        """
        spec = self.spec
        vis = Visibility(jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])) if vis is None else vis
        q, q_latent = self.query(x, vis.pos)
        window_kv = self.window_kv(x, vis.pos)
        if spec.compressed:
            if spec.owns_compressor and publish:
                shared = self.publish(x, shared, vis)
            if spec.has_indexer:
                shared, scores = self._select(x, q_latent, shared, vis, full_scores=indexer_target is not None)
        o, mass = self._attend(q, window_kv, shared, vis, with_mass=bool(spec.has_indexer and indexer_target))
        if mass is not None:
            shared = shared._replace(indexer=self._indexer_stats(indexer_target, q, window_kv, shared, vis, scores,
                                                                 mass))
        shared = shared._replace(kv=shared.kv.write_window(spec, window_kv, vis))
        return self.output(o, vis.pos), shared

    def publish(self, x: Float[Array, "B S D"], shared: Shared, vis: Visibility) -> Shared:
        """A KV source's main KV and index keys from the compressor latent, positioned at each group's first
        token (§3.3, §3.4), handed to the store."""
        spec = self.spec
        with jax.named_scope("compressor"):
            latent, slots, kv = shared.kv.compress(spec, self.compressor, x, vis)  # [B, C, H], pre-RoPE
        # the indexer reads the latent before RoPE/QDQ, detached: it learns only from its own loss
        with jax.named_scope("indexer"):
            index_k = self.indexer.keys(jax.lax.stop_gradient(latent), slots.positions, self.freqs)
        main_kv = apply_rope(latent, slots.positions, self.freqs, heads=False)
        return shared._replace(kv=kv.write_entries(spec, main_kv, index_k, slots))

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

    def _select(self, x, q_latent, shared: Shared, vis: Visibility, *, full_scores: bool):
        """Top-k (and, at the candidate source, the candidate pool) of an index source (spec §3.5, §6)."""
        with jax.named_scope("indexer"):
            return self._select_scoped(x, q_latent, shared, vis, full_scores)

    def _select_scoped(self, x, q_latent, shared: Shared, vis: Visibility, full_scores: bool):
        """Returns the new shared state and the scores over every entry before candidate restriction (or
        ``None`` where only the candidates were scored)."""
        cfg, spec = self.cfg, self.spec
        x, q_latent = jax.lax.stop_gradient((x, q_latent))  # the indexer is detached (indexer_loss)
        ent = vis.entries(spec.ratio)
        # a Reindex layer scores only its candidates when they are fewer than the entries (fewer scores and a
        # smaller [B, S, N, ·] intermediate per query), unless every entry's score is asked for (the indexer
        # loss). Both select the same entries: candidate slots are in entry order, ties go to the lower entry
        pool = None if shared.candidates is None else shared.candidates.shape[-1] * cfg.candidate_block_size
        iq, w = self.indexer.queries(x, q_latent, vis.pos, self.freqs)
        if spec.uses_candidates and not full_scores and pool < shared.kv.n_entries(spec):
            return shared._replace(topk=self._topk_in_candidates(iq, w, shared, ent)), None
        scores = visible_scores(shared.kv.index_scores(spec, iq, w), ent.hi, ent.lo)  # −∞ unless lo ≤ t < hi
        restricted = scores
        if spec.candidate_source:
            own = scores if ent.lo is None else to_document(scores, ent.lo, -jnp.inf)
            n_own = ent.hi if ent.lo is None else ent.hi - ent.lo
            shared = shared._replace(candidates=candidate_block_ids(
                own, n_own, cfg.candidate_block_size, cfg.candidate_topk_blocks, backend=cfg.kernel_backend))
        if spec.uses_candidates:
            nb = -(-scores.shape[-1] // cfg.candidate_block_size)
            allowed = expand_blocks(block_mask(shared.candidates, nb), cfg.candidate_block_size, scores.shape[-1])
            allowed = allowed if ent.lo is None else from_document(allowed, ent.lo, False)
            restricted = jnp.where(allowed, scores, -jnp.inf)
        # a decode step's unrestricted scan over many entries: the radix select instead of top_k's sort (the
        # same picks: there −∞ marks exactly the invisible entries)
        radix = (RADIX_TOPK_MIN_ENTRIES is not None and not spec.uses_candidates and ent.lo is None
                 and x.shape[1] <= index_scan.MAX_QUERIES
                 and scores.shape[-1] >= max(RADIX_TOPK_MIN_ENTRIES, cfg.index_topk))
        topk = select_topk(restricted, cfg.index_topk, ent.hi, ent.lo, radix=radix, backend=cfg.kernel_backend)
        return shared._replace(topk=topk), scores

    def _topk_in_candidates(self, iq, w, shared: Shared, ent) -> Int[Array, "B S K"]:
        """Top-k among the candidate pool's entries only, so a Reindex layer's cost does not grow with context.

        Kept blocks are ascending, so candidate slot order is entry order and ``lax.top_k`` breaks ties
        towards the lower entry exactly as the full masked scan does.
        """
        cfg = self.cfg
        bs, blocks = cfg.candidate_block_size, shared.candidates
        lo = 0 if ent.lo is None else ent.lo[..., None, None]  # blocks count from the document's first entry
        idx = (lo + blocks[..., None] * bs + jnp.arange(bs)).reshape(*blocks.shape[:2], -1)  # [B, S, NB·bs]
        ok = jnp.repeat(blocks >= 0, bs, axis=-1) & (idx < ent.hi[..., None])
        keys = shared.kv.index_keys_at(self.spec, jnp.where(ok, idx, 0), iq.dtype)
        scores = jnp.where(ok, gathered_index_scores(iq, w, keys), -jnp.inf)
        # per device on its own rows: top_k would otherwise run on the gathered batch
        j = batch_local(lambda v: jax.lax.top_k(v, min(cfg.index_topk, v.shape[-1]))[1], scores)
        sel = jnp.take_along_axis(jnp.where(ok, idx, -1), j, axis=-1)
        sel = jnp.sort(jnp.where(sel >= 0, sel, jnp.iinfo(jnp.int32).max), axis=-1)
        return jnp.where(sel < ent.hi[..., None], sel, -1).astype(jnp.int32)

    def _sink(self) -> Float[Array, "N"]:
        """The per-head sink logits as a JAX array (a converted model may hold NumPy values)."""
        return jnp.asarray(self.attn_sink[...])

    def _attend(self, q, window_kv, shared: Shared, vis: Visibility, *, with_mass: bool):
        """The sparse attention core, the layer's one call of it: window keys (this forward's and the store's),
        the selected compressed entries and the sink in one softmax (spec §3.6). Returns ``(o, mass)``."""
        spec = self.spec
        topk = shared.topk if spec.compressed else None
        if not with_mass and spec.part != "draft":
            out = shared.kv.packed_attention(spec, q, window_kv, self._sink(), topk, vis)
            if out is not None:
                return out, None
        prefix_kv, prefix_pos = shared.kv.window(spec, q.dtype)
        compressed_kv = picked = None
        if spec.compressed:
            compressed_kv, picked = shared.kv.attended_entries(spec, topk, q.dtype)
        out = sparse_api.sparse_attention(
            q, window_kv, self._sink(), self.cfg.window_size, compressed_kv, topk, vis.floor, start=vis.start,
            prefix_kv=prefix_kv, prefix_pos=prefix_pos, picked=picked, key_floor=vis.key_floor,
            return_mass=with_mass, causal=spec.part != "draft", backend=self.cfg.kernel_backend)
        return out if with_mass else (out, None)

    def _indexer_stats(self, target: str, q, window_kv, shared: Shared, vis: Visibility, scores, topk_mass
                       ) -> IndexerStats:
        """The indexer's training signal against the main attention over every visible entry (§3.6)."""
        with jax.named_scope("indexer_loss"):
            ent = vis.entries(self.spec.ratio)
            main_kv = shared.kv.main_kv(self.spec, q.dtype)
            vis_mask = visible(ent, main_kv.shape[1])
            floor = vis.key_floor  # the documents' starts, or the window floor (bounded replay, CED)
            floor = jnp.broadcast_to(jnp.asarray(vis.floor)[..., None], vis.pos.shape) if floor is None else floor
            dense = entry_mass(q, window_kv, self._sink(), self.cfg.window_size, main_kv, vis_mask, key_floor=floor)
            return indexer_stats(target, scores, vis_mask, dense, shared.topk, topk_mass)

    def output(self, o: Float[Array, "B S N H"], pos: jax.Array) -> Float[Array, "B S D"]:
        """Inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b`` (spec §3.7)."""
        cfg = self.cfg
        b, s = o.shape[:2]
        o = apply_rope(o, pos, self.freqs, heads=True, inverse=True)
        og = o.reshape(b, s, cfg.o_groups, -1)  # group g = heads [g·N/G, (g+1)·N/G)
        wo_a = self.wo_a.weight[...].astype(o.dtype).reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        u = mixed_einsum("bsox,orx->bsor", og, wo_a).astype(o.dtype)
        return self.wo_b(u.reshape(b, s, -1))
