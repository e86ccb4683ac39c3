"""The post-training objective: response-token CE of the served forward (QAT + replay), mixed with the LM objective.

The step is pre-training's (:func:`dsv41_jax.train.step.make_step`: accumulation, optimizer, router-bias rule,
sharding, metrics); this module gives it its loss (:func:`posttrain_objective`).

Per SFT row a cache-hit boundary is drawn (``posttrain.replay``; the key is ``seed``, step and micro-batch,
so resumed runs draw the same) and the row is computed as the engine serves it (:mod:`.replay`). The model
config's ``attention.cache_quant`` switches decide which cache formats are fake-quantised (straight-through
gradients). LM corpus rows (keys ``lm_*``) use the plain training forward and its packed-document loss,
weighted ``posttrain.lm_weight`` against the SFT CE's ``1 − lm_weight``.

With ``optim.indexer_kl_weight`` > 0 the indexer KL (:mod:`dsv41_jax.model.indexer_loss`, target
``optim.indexer_kl_over``) is added as in pre-training (averaged over index sources, per non-padding SFT
token), but computed on the served path: the indexer's scores are the served ones (MXFP4 q/k when
``cache_quant.index``), the target is the main attention over the served window and cache, and only the rows
the engine computes in each index source count. It is the indexer's only training signal (it is detached and
its top-k passes no LM gradient), so this is what adapts it to its quantised q/k.

With ``posttrain.distill.weight`` > 0 the step adds ``weight · KL(exact ‖ served)`` over the response tokens,
the teacher being the exact forward (``cache_quant`` off, no replay, no CED) of the current weights under
``stop_gradient`` (:mod:`.distill`): the gap ``dsv41 eval-served`` measures, as a loss.

MoE statistics (balance loss, aux-loss-free bias rule) count only the rows the engine computes in each layer:
a row before its layer's window floor is a teacher-forcing by-product, not a served token.

``remat`` means what it means in pre-training: each transformer block is rematerialised in the backward pass
(``block``: only its inputs saved; ``dots``: its matmul outputs too), here in the served forward's main pass
and in the LM rows' forward. Not in its prefix pass (:func:`~.replay.prefix_global_kv`, the exact forward up
to the last KV source, which takes no ``remat``), nor in the teacher's forward, which has no backward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv41_jax.config import CacheQuant
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.optim import OptimConfig
from dsv41_jax.optim.balance import sequence_balance_loss
from dsv41_jax.posttrain.config import PosttrainConfig
from dsv41_jax.posttrain.distill import token_kl
from dsv41_jax.posttrain.replay import ServePlan, draw_hits, served_forward
from dsv41_jax.train.step import (
    LossAux,
    Objective,
    Term,
    count,
    indexer_agreement,
    indexer_sums,
    make_step,
    packed_loss,
    split_model,
    targets_and_mask,
    token_nll,
)


def ced_cut(model_cfg, pcfg: PosttrainConfig) -> int | None:
    from dsv41_jax.engine.prefill import check_ced_cut, default_ced_cut

    if not pcfg.replay.ced:
        return None
    cut = default_ced_cut(model_cfg) if pcfg.replay.cut is None else pcfg.replay.cut
    check_ced_cut(model_cfg, cut)
    return cut


def exact_graphdef(model_cfg):
    """The graph of the same model with every fake-quant switch off: the distillation teacher's forward."""
    att = dataclasses.replace(model_cfg.attention, cache_quant=CacheQuant(False, False, False))
    return split_model(abstract_model(model_cfg.replace(attention=att)))[0]


def posttrain_objective(model_cfg, ocfg: OptimConfig, pcfg: PosttrainConfig, remat: str = "none") -> Objective:
    """SFT response CE (served) · (1 − lm_weight) + LM CE · lm_weight + balance + indexer KL + distill KL.

    Denominators: response tokens (``tokens``: SFT CE, distill KL), LM next-token targets, non-padding SFT tokens
    (indexer KL, as in pre-training), micro-batches (balance). Metrics besides the terms: ``ce`` (the two CEs
    weighted), ``hit_frac`` (rows served after a cache hit) and ``indexer_agreement``.
    """
    cut = ced_cut(model_cfg, pcfg)
    alpha, lm_w, dw = ocfg.seq_balance_alpha, pcfg.lm_weight, pcfg.distill.weight
    target = ocfg.indexer_kl_over if ocfg.indexer_kl_weight > 0 else None
    teacher_def = exact_graphdef(model_cfg) if dw > 0 else None

    terms = {"sft_ce": Term(1 - lm_w, "tokens"), "lm_ce": Term(lm_w, "lm_tokens"),
             "balance": Term(1.0, "micro_batches")}
    if target is not None:
        terms["indexer_kl"] = Term(ocfg.indexer_kl_weight, "real")
    if teacher_def is not None:
        terms["distill_kl"] = Term(dw, "tokens")
    keys = [*terms, "replayed", "rows", *(["indexer_agree", "indexer_queries"] if target is not None else [])]

    def counts(batch):
        out = {"tokens": 1.0, "lm_tokens": 1.0, "real": 1.0}
        if "tokens" in batch:
            out |= {"tokens": count(batch["loss_mask"]), "real": count(batch["segment_ids"] > 0)}
        if "lm_tokens" in batch:
            out["lm_tokens"] = count(jax.vmap(targets_and_mask)(batch["lm_tokens"], batch["lm_segment_ids"])[1])
        return out

    def sft_loss(model, mb, key) -> LossAux:
        r = pcfg.replay
        hits = draw_hits(key, mb["prompt_len"], model.cfg.attention.window_size, r.granularity, r.prob)
        out = served_forward(model, mb["tokens"], mb.get("engram_rows"), ServePlan(hits, mb["prompt_len"]),
                             cut=cut, indexer_target=target, remat=remat)
        logits, routing, floors = out[:3]
        targets = jnp.concatenate([mb["tokens"][:, 1:], jnp.zeros_like(mb["tokens"][:, :1])], axis=1)
        pos = jnp.arange(mb["tokens"].shape[1])
        live = [(pos >= f[:, None]) & (mb["segment_ids"] > 0) for f in floors]  # rows the engine computes
        sums = {"sft_ce": jnp.sum(token_nll(logits, targets) * mb["loss_mask"]),
                "balance": sum(sequence_balance_loss(rt.scores, rt.experts, alpha, lv)
                               for rt, lv in zip(routing, live, strict=True)),
                "replayed": jnp.sum(hits > 0).astype(jnp.float32), "rows": jnp.float32(hits.shape[0])}
        if target is not None:  # each index source over the rows its layer computes
            sums |= indexer_sums(out[3], [live[i] for i in model.cfg.attention.index_source_layers])
        if teacher_def is not None:  # the eval's exact path (a) of the current weights, detached
            _, params, biases, rest = split_model(model)
            teacher = nnx.merge(teacher_def, *jax.lax.stop_gradient((params, biases)), rest)
            kl = token_kl(teacher(mb["tokens"], mb.get("engram_rows")), logits)
            sums["distill_kl"] = jnp.sum(kl * mb["loss_mask"])
        return LossAux(sums, tuple(rt.experts for rt in routing), tuple(live))

    def lm_loss(model, mb) -> LossAux:
        aux = packed_loss(model, mb["lm_tokens"], mb.get("lm_engram_rows"), mb["lm_segment_ids"],
                          mb.get("lm_positions"), alpha=alpha, remat=remat)
        return aux._replace(sums={"lm_ce": aux.sums["ce"], "balance": aux.sums["balance"]})

    def loss(model, mb, key) -> LossAux:
        parts = []
        if "tokens" in mb:
            parts.append(sft_loss(model, mb, key))
        if "lm_tokens" in mb:
            parts.append(lm_loss(model, mb))
        return concat(parts, keys)

    def metrics(values, sums):
        out = {"ce": (1 - lm_w) * values["sft_ce"] + lm_w * values["lm_ce"],
               "hit_frac": sums["replayed"] / jnp.maximum(sums["rows"], 1)}
        return out | (indexer_agreement(sums) if target is not None else {})

    return Objective(terms, counts, loss, metrics)


def concat(parts: list[LossAux], keys: list[str]) -> LossAux:
    """One micro-batch's parts (SFT rows, LM rows) as one: their sums added per key (0 where a part has none),
    their rows concatenated per layer."""
    zero = jnp.zeros((), jnp.float32)
    sums = {k: sum((p.sums[k] for p in parts if k in p.sums), zero) for k in keys}
    rows = lambda per_part: tuple(jnp.concatenate(x, axis=0) for x in zip(*per_part, strict=True))
    return LossAux(sums, rows(p.experts for p in parts), rows(p.live for p in parts))


def make_posttrain_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx: optax.GradientTransformation,
                        pcfg: PosttrainConfig, seed: int, remat: str = "none", mesh: jax.sharding.Mesh | None = None):
    """Post-training's step: :func:`~dsv41_jax.train.step.make_step` with :func:`posttrain_objective` (replay
    draws keyed by ``seed``, step and micro-batch); ``batch`` leaves are [A, b, ...]."""
    return make_step(graphdef, rest, ocfg, tx, posttrain_objective(model_cfg, ocfg, pcfg, remat), mesh=mesh,
                     seed=seed)
