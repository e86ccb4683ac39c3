"""The jitted train step of pre- and post-training, and pre-training's loss.

One step (:func:`make_step`) serves both recipes; an :class:`Objective` says what differs: the micro-batch
forward and its loss terms. For a batch whose leaves are [A, b, ...] (A micro-batches of b rows), the step

* scans the micro-batches, summing their gradients. The loss is ``Σ_term weight · Σ_micro sum / count`` with
  every denominator a count over the whole step's batch (:attr:`Objective.counts`), so the accumulated
  gradient is the full-batch gradient exactly;
* applies the optimizer update;
* moves the router biases by the aux-loss-free rule after the update (they are not optimizer parameters;
  spec model §5.3, §9.1), each layer's load counted over the rows its objective marks live
  (:attr:`LossAux.live`): ``bias`` by text rows, ``bias_vl`` by image-span rows (:attr:`LossAux.image`; text
  batches mark none, so only the text biases move);
* reports each loss term, ``loss`` (their weighted sum), ``grad_norm``, ``lr``, ``tokens`` (the count
  ``tokens``: the main cross-entropy's denominator), ``imbalance``, and the objective's own metrics;
* applies nothing when ``loss`` or ``grad_norm`` is not finite (:func:`keep_if_not_finite`): the state keeps its
  values, its step counter advances, and the metric ``skipped`` is 1.0.

Pre-training's objective (:func:`pretrain_objective`): token-mean cross-entropy over positions whose next
token is in the same document (the last token of every document and padding have no target), plus the V3-style
sequence balance loss (spec model §5.3, weight ``optim.seq_balance_alpha``) per packed row, plus (when
``optim.indexer_kl_weight`` > 0) the indexer KL averaged over index sources and non-padding tokens
(:mod:`dsv41_jax.model.indexer_loss`; it trains only the indexer). The model sees the batch's documents:
``segment_ids`` and ``positions`` mask attention per document (:mod:`dsv41_jax.model.documents`).
Post-training's is :func:`dsv41_jax.posttrain.step.posttrain_objective`.

``remat`` (none | block | dots), wherever a step takes it, means one thing: every differentiated forward
rematerialises each transformer block in the backward pass, saving only the block's inputs (``block``) or
also its matmul outputs (``dots``); ``none`` saves everything (``Transformer.__call__``'s ``remat``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
from dsv41_jax.optim import OptimConfig, balance_loss, expert_load, lr_at, optimizer, router_bias_update
from dsv41_jax.optim.labels import path_name
from dsv41_jax.sharding import BATCH_AXES, activation_sharding, named_shardings, state_partition_specs

BATCH = BATCH_AXES  # mesh axes the batch is split over (experts see the tokens of their group)


class TrainState(NamedTuple):
    step: Int[Array, ""]
    params: Any  # nnx.State of nnx.Param
    biases: Any  # nnx.State of RouterBias
    opt_state: Any


def split_model(model: Transformer):
    return nnx.split(model, nnx.Param, RouterBias, ...)


# ----------------------------------------------------------------------------------------------------
# the step


class LossAux(NamedTuple):
    """What an objective's loss hands the step for one micro-batch (the step forms the loss from ``sums``)."""

    sums: dict[str, Array]  # scalars summed over micro-batches: each term's numerator, and metric counters
    experts: tuple[Array, ...]  # per MoE layer [R, S, K]: the experts each row was routed to
    live: tuple[Array, ...]  # per layer [R, S]: the rows its bias rule and imbalance count
    image: tuple[Array, ...] = ()  # per layer [R, S]: which of them are image-span tokens (they move bias_vl)


class Term(NamedTuple):
    weight: float
    over: str  # the denominator: a key of Objective.counts (or "micro_batches")


class Objective(NamedTuple):
    """What pre- and post-training differ in; :func:`make_step` does the rest."""

    terms: dict[str, Term]  # the loss terms, by the name of their sum; each is also a metric (Σ sum / count)
    counts: Callable[[dict], dict[str, Any]]  # the step's batch [A, b, ...] -> denominators (≥ 1), with "tokens"
    loss: Callable[[Transformer, dict, Array], LossAux]  # (model, micro-batch [b, ...], key) -> sums and routing
    metrics: Callable[[dict, dict], dict] = lambda values, sums: {}  # (term values, step sums) -> more metrics


def make_step(graphdef, rest, ocfg: OptimConfig, tx: optax.GradientTransformation, objective: Objective, *,
              mesh: jax.sharding.Mesh | None = None, seed: int = 0):
    """The pure step ``(TrainState, batch) -> (TrainState, metrics)``; ``batch`` leaves are [A, b, ...].

    Micro-batch ``i`` of step ``t`` gets the key ``fold_in(fold_in(key(seed), t), i)`` (a resumed run draws
    the same). With a ``mesh``, activations and the CSA2 shared state keep their batch split over ``BATCH`` at
    every block boundary (:func:`~dsv41_jax.sharding.constrain_batch`), and if its ``expert`` axis has several
    devices, MoE layers run expert-parallel (:func:`~dsv41_jax.model.moe.routed_experts_ep`).
    """
    terms = objective.terms

    def micro_loss(params, biases, mb, key, counts):
        aux = objective.loss(nnx.merge(graphdef, params, biases, rest), mb, key)
        return sum(t.weight * aux.sums[name] / counts[t.over] for name, t in terms.items()), aux

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with expert_parallel(mesh), activation_sharding(mesh):
            return _step(state, batch)

    def _step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        n_micro = next(iter(batch.values())).shape[0]
        counts = objective.counts(batch) | {"micro_batches": n_micro}
        step_key = jax.random.fold_in(jax.random.key(seed), state.step)
        keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(n_micro))

        def accumulate(grads, xs):
            (_, aux), g = grad_fn(state.params, state.biases, *xs, counts)
            return jax.tree.map(jnp.add, grads, g), aux

        if n_micro == 1:  # no accumulator: no zeroed gradient buffers, no adds, no loop
            (_, aux), grads = grad_fn(state.params, state.biases, jax.tree.map(lambda v: v[0], batch), keys[0],
                                      counts)
            aux = jax.tree.map(lambda v: v[None], aux)
        else:
            grads, aux = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, state.params), (batch, keys))
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        experts = [e.reshape(-1, *e.shape[2:]) for e in aux.experts]  # micro-batches merged: [A·R, S, K]
        live = [v.reshape(-1, v.shape[-1]) for v in aux.live]
        image = [v.reshape(-1, v.shape[-1]) for v in aux.image] or None
        biases = bias_update(state.biases, experts, live, ocfg.bias_update_speed, image)
        sums = {k: v.sum() for k, v in aux.sums.items()}
        values = {name: sums[name] / counts[t.over] for name, t in terms.items()}
        n_experts = jax.tree.leaves(state.biases)[0].shape[-1]  # every router bias is [E]
        metrics = values | {"loss": sum(t.weight * values[name] for name, t in terms.items()),
                            "grad_norm": optax.tree.norm(grads), "lr": lr_at(state.step, ocfg),
                            "tokens": counts["tokens"], "imbalance": imbalance(experts, live, n_experts)}
        new, skipped = keep_if_not_finite(TrainState(state.step + 1, params, biases, opt_state), state,
                                          metrics["loss"], metrics["grad_norm"])
        return new, metrics | objective.metrics(values, sums) | {"skipped": skipped}

    return step


def keep_if_not_finite(new: TrainState, old: TrainState, loss: Array, grad_norm: Array):
    """``new``, or ``old`` with only its step counter advanced when ``loss`` or ``grad_norm`` is not finite; and
    1.0 where the update was dropped (else 0.0). A non-finite gradient never reaches the parameters, the
    optimizer state or the router biases, so the state a run holds (and may save) stays finite; the loop
    decides whether to stop or go on (:mod:`dsv41_jax.train.guard`). The select fuses into the update."""
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new._replace(step=old.step), old)
    return kept._replace(step=new.step), 1.0 - ok.astype(jnp.float32)


def bias_update(biases, experts: list[Array], live: list[Bool[Array, "N S"]], speed: float,
                image: list[Bool[Array, "N S"]] | None = None):
    """The aux-loss-free rule (:func:`~dsv41_jax.optim.router_bias_update`), each layer's load counted over
    that layer's live rows: ``bias`` by its text rows, ``bias_vl`` by its ``image`` rows (none: all text)."""
    routing = [Routing(e, None, None) for e in experts]
    moved = {}
    for i, layer in biases["layers"].items():  # the rule on one layer's biases at a time
        new = router_bias_update({"layers": {i: layer}}, routing, speed, valid=live[i],
                                 is_image=None if image is None else image[i])
        moved |= {path_name(p): b for p, b in jax.tree_util.tree_flatten_with_path(new)[0]}
    return jax.tree_util.tree_map_with_path(lambda p, _: moved[path_name(p)], biases)


def imbalance(experts: list[Array], live: list[Array], n_experts: int) -> Array:
    """Max over MoE layers of (busiest expert's load / mean load) over live rows: 1.0 is perfectly balanced."""
    out = []
    for e, v in zip(experts, live, strict=True):
        load = expert_load(e, n_experts, v)
        out.append(load.max() / jnp.maximum(load.mean(), 1e-9))
    return jnp.max(jnp.stack(out))


# ----------------------------------------------------------------------------------------------------
# loss pieces, and pre-training's objective


def count(x: Array) -> Float[Array, ""]:
    """``Σ x`` as a step denominator: at least 1, so a batch without such tokens divides a zero sum by 1."""
    return jnp.maximum(jnp.sum(x), 1).astype(jnp.float32)


def targets_and_mask(tokens: Int[Array, "B S"], segment_ids: Int[Array, "B S"]):
    """Next token of every position and whether it counts (same document, not padding, not the last column)."""
    nxt_tok = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    nxt_seg = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    return nxt_tok, (segment_ids > 0) & (segment_ids == nxt_seg)


def token_nll(logits: Float[Array, "B S V"], targets: Int[Array, "B S"]) -> Float[Array, "B S"]:
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]


def indexer_sums(stats: tuple[IndexerStats, ...], rows: list[Bool[Array, "B S"]]) -> dict[str, Array]:
    """``indexer_kl`` (Σ KL / number of sources), ``indexer_agree`` (Σ top-k agreement) and ``indexer_queries``
    (the queries that sum is over), each index source counting the queries of its ``rows`` mask. A query that
    sees no compressed entry adds 0 to the KL sum and is left out of the agreement."""
    pairs = list(zip(stats, rows, strict=True))
    zero = jnp.zeros((), jnp.float32)
    return {"indexer_kl": sum((jnp.sum(jnp.where(r, s.kl, 0.0)) for s, r in pairs), zero) / max(len(pairs), 1),
            "indexer_agree": sum((jnp.sum(jnp.where(r & s.valid, s.agreement, 0.0)) for s, r in pairs), zero),
            "indexer_queries": jnp.asarray(sum(jnp.sum(r & s.valid) for s, r in pairs), jnp.float32)}


def indexer_agreement(sums: dict) -> dict:
    return {"indexer_agreement": sums["indexer_agree"] / jnp.maximum(sums["indexer_queries"], 1)}


def packed_loss(model: Transformer, tokens: Int[Array, "B S"], engram_rows, segment_ids: Int[Array, "B S"],
                positions, *, alpha: float, indexer_target: str | None = None, remat: str = "none") -> LossAux:
    """The training forward over packed documents: summed next-token NLL (``ce``), the sequence balance loss
    of its rows (``balance``) and, with an ``indexer_target``, :func:`indexer_sums` over non-padding tokens."""
    logits, aux = model(tokens, engram_rows, segment_ids=segment_ids, positions=positions, return_aux="routing",
                        indexer_target=indexer_target, remat=remat)  # [b, S, V]
    targets, mask = targets_and_mask(tokens, segment_ids)
    real = segment_ids > 0
    sums = {"ce": jnp.sum(token_nll(logits, targets) * mask), "balance": balance_loss(aux.routing, alpha, real)}
    if indexer_target is not None:
        sums |= indexer_sums(aux.indexer, [real] * len(aux.indexer))
    return LossAux(sums, tuple(r.experts for r in aux.routing), (real,) * len(aux.routing))


def pretrain_objective(ocfg: OptimConfig, remat: str = "none") -> Objective:
    """Packed next-token CE (token mean) + sequence balance (per micro-batch) + indexer KL (per real token)."""
    target = ocfg.indexer_kl_over if ocfg.indexer_kl_weight > 0 else None

    def counts(batch):
        return {"tokens": count(jax.vmap(targets_and_mask)(batch["tokens"], batch["segment_ids"])[1]),
                "real": count(batch["segment_ids"] > 0)}

    def loss(model, mb, key):
        return packed_loss(model, mb["tokens"], mb.get("engram_rows"), mb["segment_ids"], mb.get("positions"),
                           alpha=ocfg.seq_balance_alpha, indexer_target=target, remat=remat)

    terms = {"ce": Term(1.0, "tokens"), "balance": Term(1.0, "micro_batches")}
    if target is None:
        return Objective(terms, counts, loss)
    terms["indexer_kl"] = Term(ocfg.indexer_kl_weight, "real")
    return Objective(terms, counts, loss, lambda values, sums: indexer_agreement(sums))


def make_train_step(graphdef, rest, model_cfg, ocfg: OptimConfig, tx: optax.GradientTransformation,
                    remat: str = "none", mesh: jax.sharding.Mesh | None = None):
    """Pre-training's step: :func:`make_step` with :func:`pretrain_objective` (``model_cfg`` is not needed)."""
    return make_step(graphdef, rest, ocfg, tx, pretrain_objective(ocfg, remat), mesh=mesh)


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
