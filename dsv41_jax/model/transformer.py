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
from dsv41_jax.model.kv_store import DenseKV, PrefixReuse, Visibility
from dsv41_jax.model.layers import MATMUL, RMSNorm, fp32_head, normal
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
                 is_image: Bool[Array, "B S"] | None, vis: Visibility | None = None, *,
                 indexer_target: str | None = None, publish: bool = True):
        """Returns ``(x, pre, shared, routing)``; ``pre`` is the pre-mix the next site reads."""
        # named scopes: a profile or HLO dump attributes each op to mhc / attention (/ indexer) / moe
        with jax.named_scope("mhc"):
            a_pre, a_post, a_comb = hc_mixes(x, self.hc_attn_fn[...], self.hc_attn_base[...],
                                             self.hc_attn_scale[...], self.mhc, self.norm_eps)
            u = self.attn_norm(collapse(x, pre))  # pre from the previous site
        with jax.named_scope("attention"):
            y, shared = self.attn(u, shared, vis, indexer_target=indexer_target, publish=publish)
        with jax.named_scope("mhc"):
            x = expand(y, x, a_post, a_comb)
            f_pre, f_post, f_comb = hc_mixes(x, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...],
                                             self.mhc, self.norm_eps)
            u = self.ffn_norm(collapse(x, a_pre))
        with jax.named_scope("moe"):
            y, routing = self.ffn(u, is_image)
        with jax.named_scope("mhc"):
            x = expand(y, x, f_post, f_comb)
        return x, f_pre, shared, routing

    def publish(self, x: Float[Array, "B S M D"], pre: Float[Array, "B S M"], shared: Shared, vis: Visibility
                ) -> Shared:
        """Only the global KV of a KV source (its compressor over every row), not the rest of the block."""
        return self.attn.publish(self.attn_norm(collapse(x, pre)), shared, vis)


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

    def __call__(self, tokens: Int[Array, "B S"], engram_rows: Int[Array, "B S L G"] | None = None,
                 is_image: Bool[Array, "B S"] | None = None, *, image_embeds: Float[Array, "B S D"] | None = None,
                 segment_ids: Int[Array, "B S"] | None = None, positions: Int[Array, "B S"] | None = None,
                 return_aux: bool | str = False, indexer_target: str | None = None, remat: str = "none"):
        """Teacher-forced forward: fp32 logits [B, S, V] (and :class:`Aux`).

        ``engram_rows`` are the host-computed row ids of every Engram layer (``engram_hash``); image-span
        positions (``is_image``) take ``image_embeds`` instead of their token's embedding (aligner rows and
        delimiter vectors, ``dsv41_jax.vision.span_embeddings``), use ``bias_vl`` in the router and are DEAD
        for Engram (their row ids must be hashed with ``dead=is_image``). Without
        ``segment_ids`` each row is one sequence from position 0. With them, rows are packed documents
        (numbered runs, 0 = padding) and no information flows between the documents of a row; RoPE uses
        ``positions`` (default: the offset in the document). See :mod:`dsv41_jax.model.documents`.

        ``return_aux=True`` adds the :class:`Aux` of every layer; ``return_aux="routing"`` only its routing and
        indexer statistics (what the training losses read: the stack then runs its repeated layers as scans).
        ``indexer_target`` (``dense`` | ``topk``) adds each index source's :class:`IndexerStats` to the aux
        (:mod:`dsv41_jax.model.indexer_loss`). ``remat`` rematerialises each block in the backward pass:
        ``none``, ``block`` (save only the block inputs) or ``dots`` (save the matmul outputs).
        """
        h = self.embed_tokens(tokens, is_image, image_embeds)
        return self.forward_embeddings(h, engram_rows, is_image, segment_ids=segment_ids,
                                       positions=positions, return_aux=return_aux, indexer_target=indexer_target,
                                       remat=remat)

    def forward_embeddings(self, h: Float[Array, "B S D"], engram_rows: Int[Array, "B S L G"] | None = None,
                           is_image: Bool[Array, "B S"] | None = None, *,
                           segment_ids: Int[Array, "B S"] | None = None, positions: Int[Array, "B S"] | None = None,
                           return_aux: bool | str = False, indexer_target: str | None = None, remat: str = "none"):
        """The forward from input embeddings (image rows already merged in); arguments as :meth:`__call__`."""
        if return_aux not in (True, False, "routing"):
            raise ValueError(f"return_aux must be True, False or 'routing', got {return_aux!r}")
        self.check_engram_rows(engram_rows)
        b, s, _ = h.shape
        docs = _documents(segment_ids, positions, (b, s))
        vis = Visibility(jnp.broadcast_to(jnp.arange(s), (b, s)) if docs is None else docs.positions, docs=docs)
        x, pre = self.streams(h)
        x, pre, _, _, trace = self.run_layers(x, pre, self.dense_shared(), vis, engram_rows=engram_rows,
                                              is_image=is_image, collect=return_aux is True,
                                              schedule=Schedule(remat=remat, indexer_target=indexer_target))
        logits = self.logits(x, pre)
        if not return_aux:
            return logits
        main_hidden = jnp.concatenate(trace.targets, axis=-1) if trace.targets else None
        return logits, Aux(trace.routing, trace.streams, trace.pre, trace.shared, main_hidden, trace.indexer)

    # -- the pieces every forward is made of: training, the engine (dsv41_jax.engine.step) and the served
    # -- post-training forward (dsv41_jax.posttrain.replay)

    def embed_tokens(self, tokens: Int[Array, "B S"], is_image: Bool[Array, "B S"] | None = None,
                     image_embeds: Float[Array, "B S D"] | None = None) -> Float[Array, "B S D"]:
        """Token embeddings; image-span positions overwritten by ``image_embeds`` (spec model §3, §7.3)."""
        h = jnp.take(self.embed.weight[...], tokens, axis=0).astype(self.cfg.dtype)
        if image_embeds is None:
            return h
        if is_image is None:
            raise ValueError("image_embeds were given without is_image (token_types >= 0)")
        if image_embeds.shape != h.shape:
            raise ValueError(f"image_embeds {image_embeds.shape} must be [B, S, D] = {h.shape}")
        return jnp.where(is_image[..., None], image_embeds.astype(h.dtype), h)

    def check_engram_rows(self, engram_rows) -> None:
        if self.cfg.engram.layer_ids and engram_rows is None:
            raise ValueError("this config has Engram layers: pass engram_rows [B, S, n_engram_layers, columns] "
                             "from dsv41_jax.engram_hash")

    def streams(self, h: Float[Array, "B S D"]) -> tuple[Float[Array, "B S M D"], Float[Array, "B S M"]]:
        """The M residual streams, each a copy of the embedding, and the first site's pre-mix (stream 0)."""
        cfg = self.cfg
        b, s, _ = h.shape
        m = cfg.mhc.hc_mult
        x = jnp.broadcast_to(h.astype(cfg.dtype)[:, :, None, :], (b, s, m, cfg.dim))
        pre = jnp.broadcast_to(jax.nn.one_hot(0, m, dtype=jnp.float32), (b, s, m))
        return constrain_batch((x, pre))

    def dense_shared(self, reuse: PrefixReuse | None = None) -> Shared:
        """The CSA2 state of a full-sequence forward: entries in memory, fake-quantised per ``cache_quant``."""
        return Shared(DenseKV(reuse=reuse, qdq_main=self.cfg.attention.cache_quant.main_kv))

    def logits(self, x: Float[Array, "B S M D"], pre: Float[Array, "B S M"],
               rows: Int[Array, "B"] | None = None) -> Float[Array, "B S V"] | Float[Array, "B V"]:
        """Final collapse, norm and the fp32 head; only row ``rows[b]`` of each sequence when given ([B, V])."""
        with jax.named_scope("head"):
            out = self.norm(collapse(x, pre))
            if rows is not None:
                out = jnp.take_along_axis(out, rows[:, None, None], axis=1)[:, 0]
            return fp32_head(out, self.head.weight[...])

    def run_layers(self, x: Float[Array, "B S M D"], pre: Float[Array, "B S M"], shared: Shared, vis: Visibility, *,
                   engram_rows: Int[Array, "B S L G"] | None = None, is_image: Bool[Array, "B S"] | None = None,
                   schedule: Schedule | None = None, floor: Int[Array, "B"] | None = None, collect: bool = False):
        """The stack: Engram, then the block, layer after layer, with the CSA2 state flowing through ``shared``.

        The one loop over the blocks of every forward (training over ``DenseKV``, the engine's chunks over
        ``PackedKV``, the served post-training forward). ``schedule`` says which layers run over which rows
        (CED, bounded replay); ``floor`` is the window floor of ``schedule.truncate``. Returns ``(x, pre,
        shared, vis, trace)``: streams, pre-mix and visibility of the rows the last layer ran on (CED narrows
        them) and a :class:`Trace` (streams, pre-mixes and states per layer only with ``collect``).

        With ``scan_layers`` (the config's), over a tensor store and without ``collect``, each run of repeated
        layer groups (:func:`segments`) is one ``lax.scan`` over the groups' stacked parameters: the program
        holds one copy of the group, not one per layer (compile time), and computes what the unrolled loop
        does (to fp32 rounding: XLA fuses the two programs differently).
        """
        cfg, sch = self.cfg, Schedule() if schedule is None else schedule
        run_block = _block_runner(sch.remat, sch.indexer_target)
        t = Trace((), {}, (), (), (), (), ())
        scan = cfg.scan_layers and not collect and isinstance(shared.kv, DenseKV)
        for first, period, repeats in segments(cfg, sch, scan):
            if repeats > 1:
                x, pre, shared, t = self._scan_groups(first, period, repeats, run_block, x, pre, shared, is_image,
                                                      vis, t)
                continue
            i, block, publish = first, self.layers[first], True
            if sch.stop is not None and i >= sch.stop:
                if block.spec.owns_compressor:  # e.g. the paper's CED cut: its compressor still sees every row
                    shared = block.publish(x, pre, shared, vis)
                break
            if sch.narrow is not None and i == sch.narrow and x.shape[1] > cfg.attention.window_size:
                if block.spec.owns_compressor:  # the paper's cut: its compressor still sees every row
                    shared, publish = block.publish(x, pre, shared, vis), False
                x, pre, is_image, shared, vis = _narrow(x, pre, is_image, shared, vis, cfg.attention.window_size,
                                                        sch.truncate_narrowed)
            if sch.truncate is not None and i == sch.truncate:
                vis = vis.with_floor(jnp.maximum(vis.floor, floor))
            if block.spec.engram:
                with jax.named_scope("engram"):
                    x = block.engram(x, engram_rows[:, :, cfg.engram.layer_ids.index(i)], is_image)
            if collect and i in cfg.dspark.target_layer_ids:  # once per listing: a layer may be named twice
                feature = x.astype(jnp.float32).mean(axis=2).astype(x.dtype)
                t = t._replace(targets=t.targets + (feature,) * cfg.dspark.target_layer_ids.count(i))
            x, pre, shared, r = run_block(block, x, pre, shared, is_image, vis, publish)
            x, pre, shared, step = _after_block(block.spec, x, pre, shared)
            t = _record(t, i, r, *step)
            if collect:
                t = t._replace(streams=t.streams + (x,), pre=t.pre + (pre,), shared=t.shared + (shared,))
        return x, pre, shared, vis, t

    def _scan_groups(self, first: int, period: int, repeats: int, run_block, x, pre, shared: Shared, is_image, vis,
                     t: Trace):
        """Layers ``first .. first + period·repeats − 1`` (``repeats`` copies of one group of ``period`` blocks)
        as a scan over the groups, their parameters stacked along a new leading axis."""
        blocks = [[self.layers[first + g * period + j] for j in range(period)] for g in range(repeats)]
        graphdefs = [nnx.split(b)[0] for b in blocks[0]]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[[nnx.split(b)[1] for b in group] for group in blocks])
        specs = [b.spec for b in blocks[0]]

        def group(carry, states):
            x, pre, shared = carry
            steps = []
            for graphdef, state, spec in zip(graphdefs, states, specs, strict=True):
                x, pre, shared, r = run_block(nnx.merge(graphdef, state), x, pre, shared, is_image, vis, True)
                x, pre, shared, step = _after_block(spec, x, pre, shared)
                steps.append((r, *step))
            return (x, pre, shared), steps

        carry = (x, pre, shared)
        # the carry must keep its structure across groups (e.g. a top-k that the first group creates): if the
        # first group changes it, run that group on its own and scan the rest
        out = jax.eval_shape(group, carry, jax.tree.map(lambda a: a[0], stacked))[0]
        if _avals(out) != _avals(carry):
            carry, steps = group(carry, jax.tree.map(lambda a: a[0], stacked))
            t = _record_group(t, first, period, [steps])
            first, repeats, stacked = first + period, repeats - 1, jax.tree.map(lambda a: a[1:], stacked)
            if repeats == 1:
                carry, steps = group(carry, jax.tree.map(lambda a: a[0], stacked))
                return *carry, _record_group(t, first, period, [steps])
        carry, steps = jax.lax.scan(group, carry, stacked)
        unstacked = [jax.tree.map(lambda a, g=g: a[g], steps) for g in range(repeats)]
        return *carry, _record_group(t, first, period, unstacked)


def _avals(tree):
    return jax.tree.structure(tree), [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]


def _after_block(spec: LayerSpec, x, pre, shared: Shared):
    """The block boundary: streams and the CSA2 state a later layer reads (main KV, index keys, top-k,
    candidates) stay split over the batch, so sharding never gathers the batch onto one device; the top-k of
    an index source and its indexer statistics are taken out for the trace."""
    x, pre, shared = constrain_batch((x, pre, shared))
    indexer = shared.indexer
    return x, pre, shared._replace(indexer=None), (shared.topk if spec.has_indexer else None, indexer)


def _record(t: Trace, layer: int, routing: Routing, topk, indexer) -> Trace:
    t = t._replace(routing=t.routing + (routing,))
    if topk is not None:
        t.selections[layer] = topk
    if indexer is not None:
        t = t._replace(indexer=t.indexer + (indexer,))
    return t


def _record_group(t: Trace, first: int, period: int, groups) -> Trace:
    for g, steps in enumerate(groups):
        for j, step in enumerate(steps):
            t = _record(t, first + g * period + j, *step)
    return t


MAX_PERIOD = 4  # longest layer group a scan repeats (the release's ratio-1 Reindex + 3 × Reuse)


def segments(cfg: ModelConfig, schedule: Schedule, scan: bool = True) -> list[tuple[int, int, int]]:
    """The stack as ``(first, period, repeats)`` runs: ``repeats`` consecutive copies of a group of ``period``
    structurally identical layers (same role, ratio, rope, candidate use, no Engram), or single layers.

    Layers where the schedule acts (``stop``, ``narrow``, ``truncate``) and Engram layers (each reads its own
    row-id column) stand alone. Greedy from the bottom: at each layer the group that covers most layers.
    The release (``topology.describe``) becomes layers 0, 1, 2, Reuse × 5, 8, Reuse × 5, 14, Reuse × 5, 20,
    (Reuse × 3 + Reindex) × 4 and Reuse × 3: 14 traced blocks instead of 40.
    """
    n = cfg.n_layers
    if not scan:
        return [(i, 1, 1) for i in range(n)]
    events = {schedule.stop, schedule.narrow, schedule.truncate} - {None}

    def key(i: int):
        s = layer_spec(cfg, i)
        alone = s.engram or i in events
        return (i if alone else None, s.part, s.ratio, s.role, s.candidate_source, s.uses_candidates, s.rope)

    keys = [key(i) for i in range(n)]
    out, i = [], 0
    while i < n:
        best = (1, 1)
        for p in range(1, MAX_PERIOD + 1):
            r = 1
            while i + (r + 1) * p <= n and keys[i + r * p: i + (r + 1) * p] == keys[i: i + p]:
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        out.append((i, *best))
        i += best[0] * best[1]
    return out


class Schedule(NamedTuple):
    """Which layers run over which rows (spec attention §9). Static: part of the compiled program.

    ``stop``: layers from this one on do not run; a KV source here still writes its global KV from every row
    (a CED prefill chunk that is not the last; the post-training prefix pass). ``narrow`` (CED): layers from
    this one on run only on each sequence's last ``window`` valid rows, their windows truncated at the first
    kept row unless ``truncate_narrowed`` is off; a KV source here writes its global KV from every row first
    (the paper's cut). ``truncate``: layers from this one on see no window key below the ``floor`` given to
    :meth:`Transformer.run_layers`, every row computed (the served training forward; CED's exact oracle).
    ``remat`` (none | block | dots) rematerialises each block in the backward pass; ``indexer_target``
    asks each index source for its :class:`IndexerStats`.
    """

    stop: int | None = None
    narrow: int | None = None
    truncate_narrowed: bool = True
    truncate: int | None = None
    remat: str = "none"
    indexer_target: str | None = None


class Trace(NamedTuple):
    """What :meth:`Transformer.run_layers` saw, layer by layer."""

    routing: tuple[Routing, ...]  # every layer that ran
    selections: dict[int, Int[Array, "B S K"]]  # top-k of each index source that ran, by layer
    indexer: tuple[IndexerStats, ...]  # one per index source, with an indexer target
    streams: tuple[jax.Array, ...]  # with collect: residual streams after each block [B, S, M, D]
    pre: tuple[jax.Array, ...]  # with collect: the pre-mix each block hands on [B, S, M]
    shared: tuple[Shared, ...]  # with collect: the CSA2 state after each block
    targets: tuple[jax.Array, ...]  # with collect: DSpark target features, one [B, S, D] per target layer


def _narrow(x, pre, is_image, shared: Shared, vis: Visibility, keep: int, truncate: bool):
    """CED: each sequence's last ``keep`` valid rows (rows before the first are clipped and marked invalid)."""
    n_new = vis.valid.sum(-1)
    offset = n_new[:, None] - keep + jnp.arange(keep)[None]  # [B, keep]
    idx = jnp.maximum(offset, 0)

    def take(a):
        return None if a is None else jnp.take_along_axis(a, idx.reshape(*idx.shape, *([1] * (a.ndim - 2))), axis=1)

    pos = take(vis.pos)
    floor = jnp.maximum(vis.floor, pos[:, 0]) if truncate else vis.floor
    vis = vis._replace(pos=pos, valid=offset >= 0, floor=floor)
    shared = shared._replace(topk=take(shared.topk), candidates=take(shared.candidates))
    return take(x), take(pre), take(is_image), shared, vis


REMAT = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
         # products: XLA's dots and mixed_einsum's outputs (a custom VJP, which dots_saveable does not see)
         "dots": jax.checkpoint_policies.save_from_both_policies(
             jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(MATMUL))}


def _block_runner(remat: str, indexer_target: str | None):
    """``f(block, x, pre, shared, is_image, vis, publish)`` running one block, rematerialised per ``remat``."""
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {sorted(REMAT)}, got {remat!r}")
    if indexer_target is not None and indexer_target not in TARGETS:
        raise ValueError(f"indexer_target must be None or one of {TARGETS}, got {indexer_target!r}")

    def run(block, x, pre, shared, is_image, vis, publish):
        return block(x, pre, shared, is_image, vis, indexer_target=indexer_target, publish=publish)

    if remat == "none":
        return run

    def rematerialised(block, x, pre, shared, is_image, vis, publish):
        # a pure function of the block's state: nnx.remat would also write the state back, and the router
        # biases may belong to an outer trace (they are not differentiated)
        graphdef, state = nnx.split(block)
        body = lambda st, *a: run(nnx.merge(graphdef, st), *a, publish)
        return jax.checkpoint(body, policy=REMAT[remat])(state, x, pre, shared, is_image, vis)

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
