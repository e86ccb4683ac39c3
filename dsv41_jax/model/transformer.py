"""The V4.1 text backbone: embedding, blocks with Single-Pass mHC, final collapse, norm and fp32 head."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.attention import Attention, Shared
from dsv41_jax.model.documents import Documents, documents
from dsv41_jax.model.engram import Engram
from dsv41_jax.model.indexer_loss import TARGETS, IndexerStats
from dsv41_jax.model.layers import RMSNorm, normal
from dsv41_jax.model.mhc import collapse, expand, hc_mixes, hc_params
from dsv41_jax.model.moe import MoE, Routing
from dsv41_jax.sharding import constrain_batch, param
from dsv41_jax.topology import LayerSpec, layer_spec


class Block(nnx.Module):
    """Engram (if any) → attention site → FFN site, with the single-pass mHC schedule (spec model §4.4)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, n_experts: int, k: int, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, rngs=rngs, native=cfg.weight_format == "native")
        if spec.engram:
            rows = cfg.engram.num_embeddings[cfg.engram.layer_ids.index(spec.layer)]
            self.engram = Engram(cfg.engram, rows, cfg.dim, cfg.mhc.hc_mult, cfg.norm_eps, **kw)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=pdt)
        self.attn = Attention(cfg.attention, spec, cfg.dim, cfg.norm_eps, **kw)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=pdt)
        self.ffn = MoE(cfg.moe, cfg.dim, n_experts, k, **kw)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_params(cfg.mhc, cfg.dim, rngs)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_params(cfg.mhc, cfg.dim, rngs)
        self.mhc, self.norm_eps, self.spec = cfg.mhc, cfg.norm_eps, spec

    def __call__(self, x: Float[Array, "B S M D"], pre: Float[Array, "B S M"], shared: Shared,
                 is_image: Bool[Array, "B S"] | None, docs: Documents | None = None, *,
                 indexer_target: str | None = None):
        def attend(u):
            return self.attn(u, shared, docs, indexer_target=indexer_target)

        return self.run(x, pre, attend, is_image)

    def run(self, x: Float[Array, "B S M D"], pre: Float[Array, "B S M"], attend, is_image: Bool[Array, "B S"] | None):
        """The block with its attention given as ``attend(u) -> (y, state)``; returns ``(x, pre, state, routing)``.

        Training calls attention on a whole sequence; the engine passes a cache-reading step instead.
        """
        # named scopes: a profile or HLO dump attributes each op to mhc / attention (/ indexer) / moe
        with jax.named_scope("mhc"):
            a_pre, a_post, a_comb = hc_mixes(x, self.hc_attn_fn[...], self.hc_attn_base[...],
                                             self.hc_attn_scale[...], self.mhc, self.norm_eps)
            u = self.attn_norm(collapse(x, pre))  # pre from the previous site
        with jax.named_scope("attention"):
            y, state = attend(u)
        with jax.named_scope("mhc"):
            x = expand(y, x, a_post, a_comb)
            f_pre, f_post, f_comb = hc_mixes(x, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...],
                                             self.mhc, self.norm_eps)
            u = self.ffn_norm(collapse(x, a_pre))
        with jax.named_scope("moe"):
            y, routing = self.ffn(u, is_image)
        with jax.named_scope("mhc"):
            x = expand(y, x, f_post, f_comb)
        return x, f_pre, state, routing


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, role: str, std: float, *, param_dtype, rngs: nnx.Rngs):
        self.weight = param(role, normal(rngs, (vocab, dim), std, param_dtype))


class Aux(NamedTuple):
    """Per-layer internals of a forward, for losses (routing) and layer-by-layer checks."""

    routing: tuple[Routing, ...]
    streams: tuple[jax.Array, ...]  # residual streams after each block [B, S, M, D]
    pre: tuple[jax.Array, ...]  # the pre-mix each block hands on [B, S, M]
    shared: tuple[Shared, ...]  # CSA2 state after each block
    main_hidden: jax.Array | None  # DSpark target features [B, S, len(targets)·D]
    indexer: tuple[IndexerStats, ...] = ()  # one per index source, when an indexer target was asked for


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, "embed", 1.0, param_dtype=pdt, rngs=rngs)
        self.layers = nnx.List([
            Block(cfg, layer_spec(cfg, i), n_experts=cfg.moe.n_routed_experts, k=cfg.moe.n_activated_experts,
                  rngs=rngs) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=pdt)
        self.head = Embedding(cfg.vocab_size, cfg.dim, "head", cfg.dim ** -0.5, param_dtype=pdt, rngs=rngs)
        self.cfg = cfg

    def __call__(self, tokens: Int[Array, "B S"], engram_rows: Int[Array, "B S L C"] | None = None,
                 is_image: Bool[Array, "B S"] | None = None, *, segment_ids: Int[Array, "B S"] | None = None,
                 positions: Int[Array, "B S"] | None = None, return_aux: bool = False,
                 indexer_target: str | None = None, remat: str = "none"):
        """Teacher-forced forward: fp32 logits [B, S, V] (and :class:`Aux`).

        ``engram_rows`` are the host-computed row ids of every Engram layer (``engram_hash``); image-span
        positions (``is_image``) use ``bias_vl`` in the router and are DEAD for Engram. Without
        ``segment_ids`` each row is one sequence from position 0. With them, rows are packed documents
        (numbered runs, 0 = padding) and no information flows between the documents of a row; RoPE uses
        ``positions`` (default: the offset in the document). See :mod:`dsv41_jax.model.documents`.

        ``indexer_target`` (``dense`` | ``topk``) adds each index source's :class:`IndexerStats` to the aux
        (:mod:`dsv41_jax.model.indexer_loss`). ``remat`` rematerialises each block in the backward pass:
        ``none``, ``block`` (save only the block inputs) or ``dots`` (save the matmul outputs).
        """
        h = jnp.take(self.embed.weight[...], tokens, axis=0).astype(self.cfg.dtype)
        return self.forward_embeddings(h, engram_rows, is_image, segment_ids=segment_ids, positions=positions,
                                       return_aux=return_aux, indexer_target=indexer_target, remat=remat)

    def forward_embeddings(self, h: Float[Array, "B S D"], engram_rows: Int[Array, "B S L C"] | None = None,
                           is_image: Bool[Array, "B S"] | None = None, *,
                           segment_ids: Int[Array, "B S"] | None = None, positions: Int[Array, "B S"] | None = None,
                           return_aux: bool = False, indexer_target: str | None = None, remat: str = "none"):
        """The forward from input embeddings (image rows already merged in); arguments as :meth:`__call__`."""
        cfg = self.cfg
        if cfg.engram.layer_ids and engram_rows is None:
            raise ValueError("this config has Engram layers: pass engram_rows [B, S, n_engram_layers, columns] "
                             "from dsv41_jax.engram_hash")
        b, s, _ = h.shape
        docs = _documents(segment_ids, positions, (b, s))
        run_block = _block_runner(remat, indexer_target)
        m = cfg.mhc.hc_mult
        x = jnp.broadcast_to(h.astype(cfg.dtype)[:, :, None, :], (b, s, m, cfg.dim))
        pre = jnp.broadcast_to(jax.nn.one_hot(0, m, dtype=jnp.float32), (b, s, m))  # first site selects stream 0
        x, pre = constrain_batch((x, pre))
        shared = Shared()
        routing, streams, pres, shareds, targets, stats = [], [], [], [], [], []
        for i, block in enumerate(self.layers):
            if block.spec.engram:
                with jax.named_scope("engram"):
                    x = block.engram(x, engram_rows[:, :, cfg.engram.layer_ids.index(i)], is_image)
            if i in cfg.dspark.target_layer_ids:
                targets.append(x.astype(jnp.float32).mean(axis=2).astype(x.dtype))
            x, pre, shared, r = run_block(block, x, pre, shared, is_image, docs)
            # block boundary: streams and the CSA2 state a later layer reads (main KV, index keys, top-k,
            # candidates) stay split over the batch, so sharing never gathers the batch onto one device
            x, pre, shared = constrain_batch((x, pre, shared))
            if shared.indexer is not None:
                stats.append(shared.indexer)
                shared = shared._replace(indexer=None)
            routing.append(r)
            if return_aux:
                streams.append(x), pres.append(pre), shareds.append(shared)
        with jax.named_scope("head"):
            out = self.norm(collapse(x, pre))
            logits = jnp.einsum("bsd,vd->bsv", out.astype(jnp.float32), self.head.weight[...].astype(jnp.float32),
                                precision="highest")
        if not return_aux:
            return logits
        main_hidden = jnp.concatenate(targets, axis=-1) if targets else None
        return logits, Aux(tuple(routing), tuple(streams), tuple(pres), tuple(shareds), main_hidden, tuple(stats))


REMAT = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
         "dots": jax.checkpoint_policies.dots_saveable}


def _block_runner(remat: str, indexer_target: str | None):
    """``f(block, x, pre, shared, is_image, docs)`` running one block, rematerialised per ``remat``."""
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {sorted(REMAT)}, got {remat!r}")
    if indexer_target is not None and indexer_target not in TARGETS:
        raise ValueError(f"indexer_target must be None or one of {TARGETS}, got {indexer_target!r}")

    def run(block, x, pre, shared, is_image, docs):
        return block(x, pre, shared, is_image, docs, indexer_target=indexer_target)

    if remat == "none":
        return run

    def rematerialised(block, *args):
        # a pure function of the block's state: nnx.remat would also write the state back, and the router
        # biases may belong to an outer trace (they are not differentiated)
        graphdef, state = nnx.split(block)
        return jax.checkpoint(lambda st, *a: run(nnx.merge(graphdef, st), *a), policy=REMAT[remat])(state, *args)

    return rematerialised


def _documents(segment_ids, positions, shape) -> Documents | None:
    if segment_ids is None:
        if positions is not None:
            raise ValueError("positions were given without segment_ids: pass the packed rows' segment_ids too")
        return None
    if tuple(jnp.shape(segment_ids)) != shape:
        raise ValueError(f"segment_ids {tuple(jnp.shape(segment_ids))} must be [B, S] = {shape} like the tokens")
    return documents(segment_ids, positions)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """``Transformer(cfg)`` with ``ShapeDtypeStruct`` leaves: shapes, dtypes and sharding names, no memory.

    Each traced parameter draw makes flax probe ``tracer.sharding``; JAX answers the resulting
    AttributeError with an origin message that walks the whole jaxpr traced so far and flax discards it.
    That makes construction quadratic in the number of parameters (~10 s instead of ~1.5 s for the
    release), so the message is skipped while building (only where this JAX version has it).
    """
    from jax._src.interpreters import partial_eval as pe

    tracer = getattr(pe, "DynamicJaxprTracer", None)
    original = getattr(tracer, "_origin_msg", None)
    if original is not None:
        tracer._origin_msg = lambda self: ""
    try:
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    finally:
        if original is not None:
            tracer._origin_msg = original
