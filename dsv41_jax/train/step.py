"""The jitted train step: packed next-token loss + MoE balance, gradient accumulation, optimizer, bias rule.

Loss (per optimizer step, over all micro-batches): token-mean cross-entropy over positions whose next token
is in the same document (the last token of every document and padding have no target), plus the V3-style
sequence balance loss (spec model §5.3, weight ``optim.seq_balance_alpha``), computed per packed row, plus
(when ``optim.indexer_kl_weight`` > 0) the indexer KL averaged over index sources and non-padding tokens
(:mod:`dsv41_jax.model.indexer_loss`; it trains only the indexer). The model sees the batch's documents:
``segment_ids`` and ``positions`` mask attention per document (:mod:`dsv41_jax.model.documents`).
The router biases move by the aux-loss-free rule after the update, text and image biases each on their own
modality's load (spec model §5.3, §9.1); they are not optimizer parameters.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.model.indexer_loss import IndexerStats
from dsv41_jax.model.moe import RouterBias, Routing, expert_parallel
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig, balance_loss, lr_at, optimizer, router_bias_update
from dsv41_jax.sharding import BATCH_AXES, activation_sharding, named_shardings, state_partition_specs

BATCH = BATCH_AXES  # mesh axes the batch is split over (experts see the tokens of their group)


class TrainState(NamedTuple):
    step: Int[Array, ""]
    params: Any  # nnx.State of nnx.Param
    biases: Any  # nnx.State of RouterBias
    opt_state: Any


def targets_and_mask(tokens: Int[Array, "B S"], segment_ids: Int[Array, "B S"]):
    """Next token of every position and whether it counts (same document, not padding, not the last column)."""
    nxt_tok = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    nxt_seg = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    return nxt_tok, (segment_ids > 0) & (segment_ids == nxt_seg)


def token_nll(logits: Float[Array, "B S V"], targets: Int[Array, "B S"]) -> Float[Array, "B S"]:
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]


class StepFns(NamedTuple):
    init: Any  # (model, opt cfg) -> TrainState, see make_state
    step: Any  # jitted (TrainState, batch) -> (TrainState, metrics)
    graphdef: Any
    rest: Any


def split_model(model: Transformer):
    return nnx.split(model, nnx.Param, RouterBias, ...)


def make_train_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx: optax.GradientTransformation,
                    remat: str = "none", mesh: jax.sharding.Mesh | None = None):
    """The pure step ``(TrainState, batch) -> (TrainState, metrics)``; ``batch`` leaves are [A, b, ...].

    With a ``mesh``, activations and the CSA2 shared state keep their batch split over ``BATCH`` at every block
    boundary (:func:`~dsv41_jax.sharding.constrain_batch`), and if its ``expert`` axis has several devices,
    MoE layers run expert-parallel (:func:`~dsv41_jax.model.moe.routed_experts_ep`).

    ``remat`` (none | block | dots) rematerialises each transformer block in the backward pass.
    """
    target = ocfg.indexer_kl_over if ocfg.indexer_kl_weight > 0 else None

    def micro_loss(params, biases, mb, n_tok, n_real, n_micro):
        model = nnx.merge(graphdef, params, biases, rest)
        logits, aux = model(mb["tokens"], mb.get("engram_rows"), segment_ids=mb["segment_ids"],
                            positions=mb.get("positions"), return_aux=True, indexer_target=target,
                            remat=remat)  # [b, S, V]
        targets, mask = targets_and_mask(mb["tokens"], mb["segment_ids"])
        ce_sum = jnp.sum(token_nll(logits, targets) * mask)
        bal = balance_loss(aux.routing, ocfg.seq_balance_alpha, mb["segment_ids"] > 0)
        idx = indexer_sums(aux.indexer, mb["segment_ids"] > 0)
        # token-mean over the whole step, so accumulation gives the full-batch gradient exactly
        loss = ce_sum / n_tok + bal / n_micro + ocfg.indexer_kl_weight * idx[0] / n_real
        return loss, (ce_sum, bal, tuple(r.experts for r in aux.routing), idx)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with expert_parallel(mesh), activation_sharding(mesh):
            return _step(state, batch)

    def _step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        n_micro = batch["tokens"].shape[0]
        mask = jax.vmap(targets_and_mask)(batch["tokens"], batch["segment_ids"])[1]
        n_tok = jnp.maximum(mask.sum(), 1).astype(jnp.float32)
        n_real = jnp.maximum((batch["segment_ids"] > 0).sum(), 1).astype(jnp.float32)

        def accumulate(grads, mb):
            (_, (ce_sum, bal, experts, idx)), g = grad_fn(state.params, state.biases, mb, n_tok, n_real, n_micro)
            return jax.tree.map(jnp.add, grads, g), (ce_sum, bal, experts, idx)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (ce_sums, bals, experts, idx) = jax.lax.scan(accumulate, zeros, batch)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        # the bias rule needs only the selections; micro-batches merge into one batch axis
        routing = [Routing(e.reshape(-1, *e.shape[2:]), None, None) for e in experts]
        valid = (batch["segment_ids"] > 0).reshape(-1, batch["segment_ids"].shape[-1])
        biases = router_bias_update(state.biases, routing, ocfg.bias_update_speed, valid=valid)
        ce = ce_sums.sum() / n_tok
        bal = bals.mean()
        metrics = {"loss": ce + bal, "ce": ce, "balance": bal, "grad_norm": optax.tree.norm(grads),
                   "lr": lr_at(state.step, ocfg), "tokens": n_tok, "imbalance": _imbalance(experts, valid,
                                                                                            model_cfg)}
        if target is not None:
            kl = idx[0].sum() / n_real
            metrics |= {"loss": metrics["loss"] + ocfg.indexer_kl_weight * kl, "indexer_kl": kl,
                        "indexer_agreement": idx[1].sum() / jnp.maximum(idx[2].sum(), 1)}
        return TrainState(state.step + 1, params, biases, opt_state), metrics

    return step


def indexer_sums(stats: tuple[IndexerStats, ...], real: Bool[Array, "B S"]):
    """``(Σ KL / n_sources, Σ agreement, count)`` over non-padding queries of every index source.

    A query that sees no compressed entry adds 0 to the KL sum and is left out of the agreement.
    """
    zero = jnp.zeros((), jnp.float32)
    if not stats:
        return zero, zero, zero
    kl = sum(jnp.sum(jnp.where(real, s.kl, 0.0)) for s in stats) / len(stats)
    agree = sum(jnp.sum(jnp.where(real & s.valid, s.agreement, 0.0)) for s in stats)
    count = sum(jnp.sum(real & s.valid) for s in stats).astype(jnp.float32)
    return kl, agree, count


def _imbalance(experts, valid: Bool[Array, "N S"], model_cfg) -> Float[Array, ""]:
    """Max over MoE layers of (busiest expert's load / mean load): 1.0 is perfectly balanced."""
    n = model_cfg.moe.n_routed_experts
    out = []
    for e in experts:
        e = e.reshape(-1, *e.shape[2:])  # [N, S, K]
        w = jnp.repeat(valid.reshape(-1).astype(jnp.float32), e.shape[-1])
        load = jnp.bincount(e.reshape(-1), weights=w, length=n)
        out.append(load.max() / jnp.maximum(load.mean(), 1e-9))
    return jnp.max(jnp.stack(out))


# ----------------------------------------------------------------------------------------------------
# state creation and sharding


def build_mesh(shape: tuple[int, ...], devices=None) -> jax.sharding.Mesh:
    from dsv41_jax.train.config import MESH_AXES

    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=devices)


def state_shardings(model: Transformer, tx, mesh) -> tuple[TrainState, Any]:
    """(NamedSharding tree of the TrainState, graph pieces) from the one table of ``dsv41_jax.sharding``."""
    from dsv41_jax.optim import opt_state_partition_specs

    graphdef, params, biases, rest = split_model(model)
    named = functools.partial(named_shardings, mesh)
    p_specs = state_partition_specs(params, mesh=mesh)
    o_specs = opt_state_partition_specs(tx, params, p_specs)
    return TrainState(NamedSharding(mesh, P()), named(p_specs), named(state_partition_specs(biases, mesh=mesh)),
                      named(o_specs)), (graphdef, rest)


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P(None, BATCH))  # [A, B, ...]: micro-batch axis whole, batch over data×fsdp×expert


def init_state(model_cfg, ocfg: OptimConfig, mesh, seed: int, remat: str = "none"):
    """A fresh TrainState placed by the sharding table, and the jitted step.

    Initialisation runs eagerly then moves to the mesh: compiling an init program costs more than it saves
    at the sizes this CPU path trains (a jitted, sharded init is what large models will need).
    """
    tx = optimizer(model_cfg, ocfg)
    model = Transformer(model_cfg, rngs=nnx.Rngs(seed))
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    _, params, biases, _ = split_model(model)
    state = jax.device_put(TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params)), shardings)
    return state, jit_train_step(graphdef, rest, model_cfg, ocfg, tx, shardings, mesh, remat), shardings


def jit_train_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx, shardings: TrainState, mesh, remat: str = "none"):
    """The step jitted with the state's shardings in and out (the state is donated) and the batch's."""
    return jax.jit(make_train_step(graphdef, rest, model_cfg, ocfg, tx, remat, mesh),
                   in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, None),
                   donate_argnums=0)
