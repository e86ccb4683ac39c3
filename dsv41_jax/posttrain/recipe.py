"""The post-training recipe inside ``dsv41 train``: start from a checkpoint, then QAT + replay fine-tuning.

``posttrain.init_from`` is a ``dsv41 train`` run directory (its latest step's parameters and router biases;
the optimizer state and step restart at 0) or a ``dsv41 convert`` output. The run itself is an ordinary
training run: its own directory resumes from its own latest checkpoint, shards by the same table and
checkpoints the same TrainState, so ``init_from`` is read only when the run directory is still empty.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from dsv41_jax import config as C
from dsv41_jax.config import ConfigError
from dsv41_jax.data.tokenizer import engram_consistent
from dsv41_jax.engram_hash import EngramHasher, build_token_map
from dsv41_jax.model.dspark import abstract_drafter
from dsv41_jax.model.transformer import Transformer, abstract_model
from dsv41_jax.optim import optimizer
from dsv41_jax.posttrain.drafter import (
    DrafterState,
    PosttrainState,
    WithDrafter,
    abstract_drafter_state,
    drafter_optimizer,
    drafter_shardings,
    initial_drafter,
    stored_drafter,
)
from dsv41_jax.posttrain.sft import PosttrainData, read_pairs, sft_dataset, sft_rows
from dsv41_jax.posttrain.step import make_posttrain_step
from dsv41_jax.sharding import named_shardings, state_partition_specs
from dsv41_jax.train.checkpoint import RunCheckpointer
from dsv41_jax.train.step import TrainState, batch_sharding, split_model, state_shardings

# model keys a fine-tuning run may change without changing the parameters' shapes
_FREE = {"dtype", "param_dtype", "weight_format", "attention.cache_quant", "attention.kernel_backend",
         "engram.compressed_vocab_size"}


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "checkpoints").is_dir()


def latest_step(run_dir: str | Path) -> int | None:
    if not is_run_dir(run_dir):
        return None
    ck = RunCheckpointer(run_dir, 0, 1)
    step = ck.latest_step()
    ck.manager.close()
    return step


def saved_run_config(run_dir: str | Path) -> tuple[dict, int]:
    """(the run config saved with the latest checkpoint of ``run_dir``, that step)."""
    ck = RunCheckpointer(run_dir, 0, 1)
    step = ck.latest_step()
    if step is None:
        ck.manager.close()
        raise ConfigError(f"{run_dir}: no checkpoint under {ck.dir}")
    saved = ck.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    ck.manager.close()
    return saved, step


def run_model_config(run_dir: str | Path, saved: dict | None = None) -> C.ModelConfig:
    """The model config a run trained (Engram map from its tokenizer, as ``train.loop`` builds it)."""
    saved = saved_run_config(run_dir)[0] if saved is None else saved
    cfg = C.from_dict({**saved["model"], "preset": "v41_flash"}, f"{run_dir} (saved run config)")
    return engram_consistent(cfg, build_token_map(Path(run_dir) / "tokenizer.json"))


def check_same_model(ours: C.ModelConfig, theirs: C.ModelConfig, source: str) -> None:
    """The parameters of ``theirs`` fit ``ours``: every model key agrees except precision and fake-quant."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) and f"{prefix}{k}" not in _FREE else \
                {f"{prefix}{k}": v}
        return out

    a, b = flat(C.to_dict(ours)), flat(C.to_dict(theirs))
    diff = sorted(k for k in a if k not in _FREE and a[k] != b.get(k))
    if diff:
        raise ConfigError(f"posttrain.init_from {source}: its model differs at "
                          + ", ".join(f"model.{k} ({b.get(k)!r} there, {a[k]!r} here)" for k in diff[:8]))


def restore_run_variables(run_dir: str | Path, params, biases):
    """``(params, biases)`` of the latest step of a run, restored onto the shardings of the abstract
    ``params`` / ``biases`` (``ShapeDtypeStruct`` leaves with ``sharding``); the optimizer state is not read."""
    ck = RunCheckpointer(run_dir, 0, 1)
    step = ck.latest_step()
    item = {"params": params, "biases": biases}
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), item)
    out = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True)))["state"]
    ck.manager.close()
    return out["params"], out["biases"]


def with_shardings(tree, shardings):
    """``tree``'s leaves as ``ShapeDtypeStruct`` placed by the matching leaves of ``shardings`` (the same tree
    with a sharding where ``tree`` has a variable)."""
    leaves, treedef = jax.tree.flatten(tree)
    placed = jax.tree.leaves(shardings)
    if len(placed) != len(leaves):
        raise ValueError(f"{len(placed)} shardings for {len(leaves)} arrays")
    return treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                              for x, s in zip(leaves, placed, strict=True)])


def initial_variables(init_from: str, model_cfg: C.ModelConfig, shardings: TrainState):
    """``(params, biases)`` from ``init_from`` placed by ``shardings`` (the new run's TrainState shardings)."""
    _, params, biases, _ = split_model(abstract_model(model_cfg))
    if is_run_dir(init_from):
        check_same_model(model_cfg, run_model_config(init_from), init_from)
        return restore_run_variables(init_from, with_shardings(params, shardings.params),
                                     with_shardings(biases, shardings.biases))
    from dsv41_jax.checkpoint.load import model_from_orbax

    model, _ = model_from_orbax(init_from, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype)
    check_same_model(model_cfg, model.cfg, init_from)
    _, p, b, _ = split_model(model)
    return jax.device_put(p, shardings.params), jax.device_put(b, shardings.biases)


def prepare_tokenizer(init_from: str, run_dir: Path) -> None:
    """A fine-tuning run keeps its source's tokenizer: copied to ``<run>/tokenizer.json`` (where ``data.tokenizer:
    train`` finds it instead of training a new one)."""
    src, dst = Path(init_from) / "tokenizer.json", run_dir / "tokenizer.json"
    if not dst.exists():
        if not src.exists():
            raise ConfigError(f"posttrain.init_from {init_from}: no tokenizer.json (set data.tokenizer to its path)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def setup_posttrain(cfg, model_cfg: C.ModelConfig, mesh, tok_path: Path, token_map, docs: list[str], log=print):
    """``(state, jitted step, dataset, data)`` of a fine-tuning run. The state holds the parameters of
    ``init_from`` and a fresh optimizer, or, when the run directory has a checkpoint of its own (which the
    loop then restores), only the abstract shapes and shardings."""
    pcfg, d = cfg.posttrain, cfg.data
    last = latest_step(cfg.run_dir)
    resuming = last is not None
    tx = optimizer(model_cfg, cfg.optim)
    model = abstract_model(model_cfg)
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    if resuming:
        _, params, biases, _ = split_model(model)
        abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, biases, jax.eval_shape(tx.init, params))
        state = with_shardings(abstract, shardings)
        kept = pcfg.drafter.train and stored_drafter(cfg.run_dir / "checkpoints" / str(last))
        drafter = abstract_drafter(model_cfg) if kept else None
    else:
        params, biases = initial_variables(pcfg.init_from, model_cfg, shardings)
        state = jax.device_put(TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params)), shardings)
        drafter = initial_drafter(pcfg, model_cfg, log)
    log(f"fine-tuning from {pcfg.init_from}; fake-quant {dataclasses.asdict(model_cfg.attention.cache_quant)}; "
        f"replay {dataclasses.asdict(pcfg.replay)}; lm_weight {pcfg.lm_weight}")
    step = make_posttrain_step(graphdef, rest, model_cfg, cfg.optim, tx, pcfg, cfg.seed, cfg.remat, mesh)
    step = jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, None),
                   donate_argnums=0)
    if drafter is not None:  # the drafter kept in step (dsv41_jax.posttrain.drafter)
        dtx = drafter_optimizer(model_cfg, cfg.optim, pcfg.drafter)
        placed = drafter_shardings(drafter, dtx, mesh)
        if resuming:
            dstate = with_shardings(abstract_drafter_state(model_cfg, cfg.optim, pcfg.drafter), placed)
        else:
            dparams = nnx.split(drafter, nnx.Param, ...)[1]
            dstate = jax.device_put(DrafterState(dparams, dtx.init(dparams)), placed)
        state = PosttrainState(*state, dstate)
        step = WithDrafter(step, drafter, graphdef, rest, dtx, pcfg.drafter, cfg.seed, mesh)
    pi, pc = jax.process_index(), jax.process_count()
    sft_ds = lm_ds = None
    if pcfg.lm_weight < 1.0:
        pairs = read_pairs(pcfg.sft.paths, pcfg.sft.prompt_key, pcfg.sft.response_key, pcfg.sft.max_pairs)
        rows = sft_rows(pairs, tok_path, model_cfg, pcfg.sft, d.seq_len, token_map)
        log(f"{len(rows)} of {len(pairs)} SFT pairs fit data.seq_len {d.seq_len}")
        sft_ds = sft_dataset(rows, batch_size=d.batch_size, seed=cfg.seed, process_index=pi, process_count=pc)
    if pcfg.lm_weight > 0.0:
        from dsv41_jax.data.pipeline import packed_dataset

        lm_ds = packed_dataset(docs, tok_path, model_cfg, token_map, seq_len=d.seq_len, batch_size=d.batch_size,
                               seed=cfg.seed, process_index=pi, process_count=pc, packing=d.packing,
                               packing_bins=d.packing_bins)
    data = PosttrainData(None if sft_ds is None else iter(sft_ds), None if lm_ds is None else iter(lm_ds))
    return state, step, sft_ds or lm_ds, data


def load_run_model(run_dir: str | Path, *, dtype: str = "float32", cache_quant: C.CacheQuant | None = None,
                   mesh: jax.sharding.Mesh | None = None) -> tuple[Transformer, EngramHasher]:
    """A run's latest parameters as a model, with ``cache_quant`` switches if given: on one device, or on
    ``mesh`` restored straight into the shards the sharding table gives each variable."""
    cfg = run_model_config(run_dir).replace(dtype=dtype)
    if cache_quant is not None:
        cfg = cfg.replace(attention=dataclasses.replace(cfg.attention, cache_quant=cache_quant))
    model = abstract_model(cfg)
    graphdef, params, biases, rest = split_model(model)
    if mesh is None:
        one = SingleDeviceSharding(jax.devices()[0])
        put = lambda t: with_shardings(t, [one] * len(jax.tree.leaves(t)))
    else:
        put = lambda t: with_shardings(t, named_shardings(mesh, state_partition_specs(t, mesh=mesh)))
    params, biases = restore_run_variables(run_dir, put(params), put(biases))
    model = nnx.merge(graphdef, params, biases, rest)
    return model, EngramHasher(cfg.engram, build_token_map(Path(run_dir) / "tokenizer.json"))

