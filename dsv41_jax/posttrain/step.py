"""The post-training step: response-token CE of the served forward (QAT + replay), mixed with the LM objective.

Per SFT row a cache-hit boundary is drawn (``posttrain.replay``; the key is ``seed``, step and micro-batch,
so resumed runs draw the same) and the row is computed as the engine serves it (:mod:`.replay`). The model
config's ``attention.cache_quant`` switches decide which cache formats are fake-quantised (straight-through
gradients). LM corpus rows (keys ``lm_*``) use the plain training forward and its packed-document loss.

With ``optim.indexer_kl_weight`` > 0 the indexer KL (:mod:`dsv41_jax.model.indexer_loss`, target
``optim.indexer_kl_over``) is added as in pre-training (``train.step``: averaged over index sources, per
non-padding SFT token), but computed on the served path: the indexer's scores are the served ones (MXFP4 q/k
when ``cache_quant.index``), the target is the main attention over the served window and cache, and only
the rows the engine computes in each index source count. It is the indexer's only training signal (it is
detached and its top-k passes no LM gradient), so this is what adapts it to its quantised q/k.

With ``posttrain.distill.weight`` > 0 the step adds ``weight · KL(exact ‖ served)`` over the response tokens,
the teacher being the exact forward (``cache_quant`` off, no replay, no CED) of the current weights under
``stop_gradient`` (:mod:`.distill`): the gap ``dsv41 eval-served`` measures, as a loss.

MoE statistics (balance loss, aux-loss-free bias rule) count only the rows the engine computes in each layer:
a row before its layer's window floor is a teacher-forcing by-product, not a served token.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool

from dsv41_jax.config import CacheQuant
from dsv41_jax.model.moe import Routing, expert_parallel
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.optim import OptimConfig, lr_at, router_bias_update
from dsv41_jax.optim.balance import expert_load, sequence_balance_loss
from dsv41_jax.optim.labels import path_name
from dsv41_jax.posttrain.config import PosttrainConfig
from dsv41_jax.posttrain.distill import token_kl
from dsv41_jax.posttrain.replay import ServePlan, draw_hits, served_forward
from dsv41_jax.sharding import activation_sharding
from dsv41_jax.train.step import TrainState, indexer_sums, split_model, targets_and_mask, token_nll

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MicroOut(NamedTuple):
    sft_sum: Array  # summed response-token NLL
    lm_sum: Array  # summed LM NLL
    balance: Array
    experts: tuple[Array, ...]  # per layer [R, S, K], SFT rows then LM rows
    live: tuple[Array, ...]  # per layer [R, S]: rows the served path computes
    hits: Array  # [b] the drawn boundaries
    indexer: tuple[Array, Array, Array]  # indexer_sums over the live SFT rows (zeros without the KL)
    distill_sum: Array  # summed response-token KL(exact ‖ served) (zero without posttrain.distill)


def ced_cut(model_cfg, pcfg: PosttrainConfig) -> int | None:
    from dsv41_jax.engine.prefill import check_ced_cut, default_ced_cut

    if not pcfg.replay.ced:
        return None
    cut = default_ced_cut(model_cfg) if pcfg.replay.cut is None else pcfg.replay.cut
    check_ced_cut(model_cfg, cut)
    return cut


def _sft_part(model, mb: dict, key: Array, pcfg: PosttrainConfig, cut: int | None, alpha: float,
              indexer_target: str | None = None):
    r = pcfg.replay
    w = model.cfg.attention.window_size
    hits = draw_hits(key, mb["prompt_len"], w, r.granularity, r.prob)
    out = served_forward(model, mb["tokens"], mb.get("engram_rows"), ServePlan(hits, mb["prompt_len"]), cut=cut,
                         indexer_target=indexer_target)
    logits, routing, floors = out[:3]
    targets = jnp.concatenate([mb["tokens"][:, 1:], jnp.zeros_like(mb["tokens"][:, :1])], axis=1)
    nll_sum = jnp.sum(token_nll(logits, targets) * mb["loss_mask"])
    pos = jnp.arange(mb["tokens"].shape[1])
    live = [(pos >= f[:, None]) & (mb["segment_ids"] > 0) for f in floors]
    bal = sum(sequence_balance_loss(rt.scores, rt.experts, alpha, lv) for rt, lv in zip(routing, live, strict=True))
    idx = indexer_sums((), live[0])
    if indexer_target is not None:  # each index source over the rows its layer computes
        src = model.cfg.attention.index_source_layers
        idx = tuple(sum(parts) for parts in zip(*(indexer_sums((st,), live[layer])
                                                   for st, layer in zip(out[3], src, strict=True)), strict=True))
        idx = (idx[0] / len(src), idx[1], idx[2])
    return nll_sum, bal, routing, live, hits, idx, logits


def exact_graphdef(model_cfg):
    """The graph of the same model with every fake-quant switch off: the distillation teacher's forward."""
    att = dataclasses.replace(model_cfg.attention, cache_quant=CacheQuant(False, False, False))
    return split_model(abstract_model(model_cfg.replace(attention=att)))[0]


def make_posttrain_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx: optax.GradientTransformation,
                        pcfg: PosttrainConfig, seed: int, remat: str = "none", mesh: jax.sharding.Mesh | None = None):
    """The pure step ``(TrainState, batch) -> (TrainState, metrics)``; ``batch`` leaves are [A, b, ...].

    A ``mesh`` is used as in pre-training (:func:`dsv41_jax.train.step.make_train_step`): batch-split
    activations and shared state, per-device top-k, expert-parallel MoE when its ``expert`` axis is split.
    """
    step = _make_step(graphdef, rest, model_cfg, ocfg, tx, pcfg, seed, remat)

    def sharded_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with expert_parallel(mesh), activation_sharding(mesh):
            return step(state, batch)

    return sharded_step


def _make_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx: optax.GradientTransformation,
               pcfg: PosttrainConfig, seed: int, remat: str):
    cut = ced_cut(model_cfg, pcfg)
    lm_w = pcfg.lm_weight
    alpha = ocfg.seq_balance_alpha
    target = ocfg.indexer_kl_over if ocfg.indexer_kl_weight > 0 else None
    dw = pcfg.distill.weight
    teacher_def = exact_graphdef(model_cfg) if dw > 0 else None

    def micro_loss(params, biases, mb, key, n_sft, n_lm, n_real, n_micro):
        model = nnx.merge(graphdef, params, biases, rest)
        zero = jnp.zeros((), jnp.float32)
        sft_sum = lm_sum = bal = kl_sum = zero
        experts, live = [[] for _ in model.layers], [[] for _ in model.layers]
        hits = jnp.zeros((0,), jnp.int32)
        idx = (zero, zero, zero)
        if "tokens" in mb:
            sft_sum, bal, routing, sft_live, hits, idx, logits = _sft_part(model, mb, key, pcfg, cut, alpha, target)
            for i, (rt, lv) in enumerate(zip(routing, sft_live, strict=True)):
                experts[i].append(rt.experts), live[i].append(lv)
            if teacher_def is not None:  # the eval's exact path (a) of the current weights, detached
                sg = jax.lax.stop_gradient
                teacher = nnx.merge(teacher_def, sg(params), sg(biases), rest)
                kl_sum = jnp.sum(token_kl(teacher(mb["tokens"], mb.get("engram_rows")), logits) * mb["loss_mask"])
        if "lm_tokens" in mb:
            logits, aux = model(mb["lm_tokens"], mb.get("lm_engram_rows"), segment_ids=mb["lm_segment_ids"],
                                positions=mb.get("lm_positions"), return_aux=True)  # packed: documents masked
            targets, mask = targets_and_mask(mb["lm_tokens"], mb["lm_segment_ids"])
            lm_sum = jnp.sum(token_nll(logits, targets) * mask)
            valid = mb["lm_segment_ids"] > 0
            bal = bal + sum(sequence_balance_loss(rt.scores, rt.experts, alpha, valid) for rt in aux.routing)
            for i, rt in enumerate(aux.routing):
                experts[i].append(rt.experts), live[i].append(valid)
        loss = (1 - lm_w) * sft_sum / n_sft + lm_w * lm_sum / n_lm + bal / n_micro
        loss = loss + ocfg.indexer_kl_weight * idx[0] / n_real + dw * kl_sum / n_sft
        cat = lambda xs: tuple(jnp.concatenate(x, axis=0) for x in xs)
        return loss, MicroOut(sft_sum, lm_sum, bal, cat(experts), cat(live), hits, idx, kl_sum)

    if remat != "none":
        policy = jax.checkpoint_policies.dots_saveable if remat == "dots" else None
        micro_loss = jax.checkpoint(micro_loss, policy=policy)
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        n_micro = next(iter(batch.values())).shape[0]
        n_sft = jnp.maximum(batch["loss_mask"].sum(), 1).astype(jnp.float32) if "loss_mask" in batch else 1.0
        n_lm = 1.0
        n_real = 1.0  # non-padding SFT tokens: the indexer KL's denominator, as in pre-training
        if "segment_ids" in batch:
            n_real = jnp.maximum((batch["segment_ids"] > 0).sum(), 1).astype(jnp.float32)
        if "lm_tokens" in batch:
            n_lm = jnp.maximum(jax.vmap(targets_and_mask)(batch["lm_tokens"], batch["lm_segment_ids"])[1].sum(),
                               1).astype(jnp.float32)
        step_key = jax.random.fold_in(jax.random.key(seed), state.step)
        keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(n_micro))

        def accumulate(grads, xs):
            mb, key = xs
            (_, out), g = grad_fn(state.params, state.biases, mb, key, n_sft, n_lm, n_real, n_micro)
            return jax.tree.map(jnp.add, grads, g), out

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, out = jax.lax.scan(accumulate, zeros, (batch, keys))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        experts = [e.reshape(-1, *e.shape[2:]) for e in out.experts]  # micro-batches merged: [A·R, S, K]
        live = [v.reshape(-1, v.shape[-1]) for v in out.live]
        biases = bias_update(state.biases, experts, live, ocfg.bias_update_speed)
        sft_ce, lm_ce = out.sft_sum.sum() / n_sft, out.lm_sum.sum() / n_lm
        ce = (1 - lm_w) * sft_ce + lm_w * lm_ce
        bal = out.balance.mean()
        metrics = {"loss": ce + bal, "ce": ce, "sft_ce": sft_ce, "lm_ce": lm_ce, "balance": bal,
                   "grad_norm": optax.tree.norm(grads), "lr": lr_at(state.step, ocfg), "tokens": n_sft,
                   "hit_frac": (out.hits > 0).mean() if out.hits.size else jnp.zeros(()),
                   "imbalance": imbalance(experts, live, model_cfg.moe.n_routed_experts)}
        if target is not None:
            kl = out.indexer[0].sum() / n_real
            metrics |= {"loss": metrics["loss"] + ocfg.indexer_kl_weight * kl, "indexer_kl": kl,
                        "indexer_agreement": out.indexer[1].sum() / jnp.maximum(out.indexer[2].sum(), 1)}
        if teacher_def is not None:
            kl = out.distill_sum.sum() / n_sft
            metrics |= {"loss": metrics["loss"] + dw * kl, "distill_kl": kl}
        return TrainState(state.step + 1, params, biases, opt_state), metrics

    return step


def bias_update(biases, experts: list[Array], live: list[Bool[Array, "N S"]], speed: float):
    """The aux-loss-free rule (``optim.router_bias_update``), each layer's load counted over its own live rows
    (the updates of the other layers in each call are dead code that XLA removes)."""
    routing = [Routing(e, None, None) for e in experts]
    per_layer = [router_bias_update(biases, routing, speed, valid=v) for v in live]

    def pick(path, *versions):
        return versions[int(_LAYER.search(path_name(path)).group(1))]

    return jax.tree_util.tree_map_with_path(pick, *per_layer)


def imbalance(experts: list[Array], live: list[Array], n_experts: int) -> Array:
    """Max over MoE layers of (busiest expert's load / mean load) over live rows: 1.0 is perfectly balanced."""
    out = []
    for e, v in zip(experts, live, strict=True):
        load = expert_load(e, n_experts, v)
        out.append(load.max() / jnp.maximum(load.mean(), 1e-9))
    return jnp.max(jnp.stack(out))
