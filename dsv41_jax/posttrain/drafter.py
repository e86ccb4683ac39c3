"""The DSpark drafter kept in step during post-training (spec model §8.5): the backbone changes, so its drafter
trains alongside.

When ``posttrain.drafter.train`` is on and a drafter is found (``posttrain.drafter.init_from``, a drafter.npz;
else the ``posttrain.init_from`` checkpoint's own: the ``mtp.*`` of a converted checkpoint, or the drafter a
post-training run kept), each step of the run is the post-training step of the backbone, unchanged, followed
by one update of the drafter's DSpark loss (:func:`dsv41_jax.train.dspark.drafter_update`: CE + TV +
confidence BCE over many anchors per row) against the backbone's new weights on the same batch (SFT rows and
LM rows alike). The drafter's loss is differentiated in the drafter's parameters only, so no gradient reaches
the backbone, its router biases or its optimizer state.

The drafter needs the target's features at every anchor, which the served forward does not compute (CED
keeps only the last window's rows after its cut): its update runs its own teacher-forced forward of the new
weights, about a third of a step's compute more. The drafter and its optimizer state are part of the run's
checkpoints (:class:`PosttrainState`), so a resumed run continues both; its learning rate follows the run's
schedule scaled to ``posttrain.drafter.lr``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.config import ConfigError
from dsv41_jax.model.dspark import DSpark, abstract_drafter
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.optim import OptimConfig, lr_at, opt_state_partition_specs, optimizer
from dsv41_jax.posttrain.config import DrafterConfig, PosttrainConfig
from dsv41_jax.sharding import activation_sharding, named_shardings, state_partition_specs
from dsv41_jax.train.dspark import drafter_update
from dsv41_jax.train.step import TrainState


class DrafterState(NamedTuple):
    params: Any  # nnx.State of the drafter's nnx.Param
    opt_state: Any


class PosttrainState(NamedTuple):
    """A post-training run's state with its drafter: :class:`~dsv41_jax.train.step.TrainState`'s fields, then
    the drafter's."""

    step: Any
    params: Any
    biases: Any
    opt_state: Any
    drafter: DrafterState

    def backbone(self) -> TrainState:
        return TrainState(self.step, self.params, self.biases, self.opt_state)


def drafter_optimizer(model_cfg: C.ModelConfig, ocfg: OptimConfig, dcfg: DrafterConfig) -> optax.GradientTransformation:
    """The V4.1 optimizer groups over the drafter, at the run's schedule scaled to ``dcfg.lr``."""
    return optimizer(model_cfg, ocfg, lr=lambda count: lr_at(count, ocfg) * (dcfg.lr / ocfg.lr))


def abstract_drafter_state(model_cfg: C.ModelConfig, ocfg: OptimConfig, dcfg: DrafterConfig) -> DrafterState:
    """A :class:`DrafterState` of ``ShapeDtypeStruct`` leaves (what a checkpoint holds), no memory."""
    params = nnx.split(abstract_drafter(model_cfg), nnx.Param, ...)[1]
    return DrafterState(params, jax.eval_shape(drafter_optimizer(model_cfg, ocfg, dcfg).init, params))


def stored_drafter(step_dir: Path) -> bool:
    """Whether the train state saved in a run's ``checkpoints/<step>`` holds a drafter (an unreadable one: no)."""
    import orbax.checkpoint as ocp

    try:
        tree = ocp.StandardCheckpointHandler().metadata(Path(step_dir) / "state").tree
    except Exception:  # noqa: BLE001 - damage is reported by the restore that follows
        return False
    return isinstance(tree, dict) and "drafter" in tree


def run_drafter(run_dir: str | Path, model_cfg: C.ModelConfig) -> DSpark | None:
    """The drafter a post-training run kept in step (its latest checkpoint's), on one device; None if none."""
    import orbax.checkpoint as ocp

    from dsv41_jax.train.checkpoint import RunCheckpointer

    ck = RunCheckpointer(run_dir, 0, 1)
    try:
        step = ck.latest_step()
        if step is None or not stored_drafter(ck.dir / str(step)):
            return None
        graphdef, params, rest = nnx.split(abstract_drafter(model_cfg), nnx.Param, ...)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        item = {"drafter": {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                                                   params)}}
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), item)
        out = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True)))["state"]
    finally:
        ck.manager.close()
    return nnx.merge(graphdef, out["drafter"]["params"], rest)


def initial_drafter(pcfg: PosttrainConfig, model_cfg: C.ModelConfig, log: Callable[[str], None] = print
                    ) -> DSpark | None:
    """The drafter a fine-tuning run starts from (see the module doc), or None when it has none to keep."""
    from dsv41_jax.posttrain.recipe import is_run_dir
    from dsv41_jax.train.dspark import load_drafter_npz

    d = pcfg.drafter
    if not d.train or model_cfg.dspark.n_layers < 1:
        return None
    if d.init_from:
        try:
            drafter = load_drafter_npz(d.init_from, model_cfg)
        except (OSError, ValueError) as err:
            raise ConfigError(f"posttrain.drafter.init_from {d.init_from}: not a drafter of this model "
                              f"({err})") from None
        log(f"drafter from {d.init_from}, kept in step with the backbone")
        return drafter
    if is_run_dir(pcfg.init_from):
        drafter = run_drafter(pcfg.init_from, model_cfg)
    else:
        from dsv41_jax.checkpoint.load import drafter_from_orbax

        try:
            drafter = drafter_from_orbax(pcfg.init_from, model_cfg)
        except Exception as err:  # noqa: BLE001 - a checkpoint without mtp.* (or unreadable ones): no drafter
            log(f"{pcfg.init_from} holds no DSpark drafter ({' '.join(str(err).split())[:200]}): the backbone "
                "trains alone")
            return None
    if drafter is None:
        log(f"{pcfg.init_from} holds no DSpark drafter (posttrain.drafter.init_from can name a drafter.npz): "
            "the backbone trains alone")
        return None
    log(f"the drafter of {pcfg.init_from}, kept in step with the backbone")
    return drafter


def drafter_shardings(drafter: DSpark, tx: optax.GradientTransformation, mesh) -> DrafterState:
    """NamedShardings of a :class:`DrafterState` by the sharding table (optimizer buffers like their params)."""
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    specs = state_partition_specs(params, mesh=mesh)
    return DrafterState(named_shardings(mesh, specs), named_shardings(mesh, opt_state_partition_specs(tx, params,
                                                                                                        specs)))


def drafter_rows(batch: dict) -> dict:
    """The step's rows [A, b, ...] as one drafter batch [A·b, ...]: SFT rows (one conversation each, from
    position 0) and LM rows (packed documents), concatenated."""
    parts = []
    for prefix in ("", "lm_"):
        if prefix + "tokens" not in batch:
            continue
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items() if k.startswith(prefix)}
        rows = {k.removeprefix(prefix): flat[k] for k in flat if prefix or not k.startswith("lm_")}
        if "positions" not in rows:
            rows["positions"] = jnp.broadcast_to(jnp.arange(rows["tokens"].shape[1]), rows["tokens"].shape)
        parts.append({k: rows[k] for k in ("tokens", "segment_ids", "positions", "engram_rows") if k in rows})
    return {k: jnp.concatenate([p[k] for p in parts]) for k in parts[0]}


class WithDrafter:
    """Post-training's step ``(PosttrainState, batch) -> (PosttrainState, metrics)``: :attr:`backbone` (the
    compiled post-training step, untouched), then the drafter's update against its new weights. The drafter's
    metrics are added as ``drafter_<name>`` (``drafter_loss``, ``drafter_accept_slot0``, ...)."""

    def __init__(self, backbone: Callable, drafter: DSpark, graphdef, rest, tx: optax.GradientTransformation,
                 dcfg: DrafterConfig, seed: int, mesh=None):
        update = drafter_update(drafter, graphdef, tx, dcfg)

        def drafter_step(d: DrafterState, params, biases, batch, key):
            with expert_parallel(mesh), activation_sharding(mesh):
                p, o, metrics = update(d.params, d.opt_state, (params, biases, rest), drafter_rows(batch), key)
            return DrafterState(p, o), metrics

        self.backbone = backbone
        self.drafter_step = jax.jit(drafter_step, donate_argnums=0)
        self.key = jax.random.fold_in(jax.random.key(seed), 0x0D5A)  # apart from the backbone's replay draws

    def __call__(self, state: PosttrainState, batch: dict) -> tuple[PosttrainState, dict]:
        key = jax.random.fold_in(self.key, state.step)  # (the backbone step donates the state's buffers)
        new, metrics = self.backbone(state.backbone(), batch)
        d, dm = self.drafter_step(state.drafter, new.params, new.biases, batch, key)
        return PosttrainState(*new, d), metrics | {f"drafter_{k}": v for k, v in dm.items()}
