"""Ahead-of-time lowering of the sharded train step from shapes alone (nothing is allocated).

:func:`abstract_step` builds the :class:`~dsv41_jax.train.step.TrainState` and a batch as
``jax.ShapeDtypeStruct`` leaves that carry their ``NamedSharding`` (the sharding table of
``dsv41_jax.sharding``), and the jitted step exactly as :func:`~dsv41_jax.train.step.init_state` builds it.
``step.lower(state, batch)`` then traces and partitions the real program for any mesh whose devices exist,
e.g. 64 fake CPU devices (:func:`use_fake_cpus`); ``.compile().memory_analysis()`` gives XLA's per-device
argument, output and temporary bytes, and ``dsv41_jax.train.hlo`` reads its collectives.
"""

from __future__ import annotations

import math
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.optim import OptimConfig, optimizer
from dsv41_jax.train.step import TrainState, batch_sharding, jit_train_step, split_model, state_shardings


def use_fake_cpus(n: int) -> None:
    """Make this process see ``n`` CPU devices; must run before anything touches a device."""
    try:
        if "jax_num_cpu_devices" in jax.config.values:
            jax.config.update("jax_num_cpu_devices", n)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # JAX has started: fine if it already has these devices
        pass
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        + [f"--xla_force_host_platform_device_count={n}"])
    if jax.device_count() != n:
        raise ConfigError(f"asked for {n} fake CPU devices but JAX already started with {jax.device_count()}: "
                          "choose the device count before anything touches a device")


def abstract_batch(model_cfg: ModelConfig, grad_accum: int, batch: int, seq: int, mesh) -> dict:
    """The step's batch [A, B, S, ...] as sharded ``ShapeDtypeStruct``s (the keys the data pipeline yields)."""
    sharding = batch_sharding(mesh)
    sds = lambda *shape: jax.ShapeDtypeStruct((grad_accum, batch, seq, *shape), jnp.int32, sharding=sharding)
    out = {"tokens": sds(), "segment_ids": sds(), "positions": sds()}
    if model_cfg.engram.layer_ids:
        out["engram_rows"] = sds(len(model_cfg.engram.layer_ids), model_cfg.engram.n_columns)
    return out


def abstract_step(model_cfg: ModelConfig, ocfg: OptimConfig, mesh, batch: int, seq: int, grad_accum: int = 1,
                  remat: str = "none"):
    """``(jitted step, abstract TrainState, abstract batch)``: shapes and shardings only."""
    from dsv41_jax.model.transformer import abstract_model

    tx = optimizer(model_cfg, ocfg)
    model = abstract_model(model_cfg)
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    _, params, biases, _ = split_model(model)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, biases, jax.eval_shape(tx.init, params))
    leaves, treedef = jax.tree.flatten(state)  # the sharding tree has no Variable nodes: match leaf by leaf
    state = treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(
        leaves, jax.tree.leaves(shardings), strict=True)])
    step = jit_train_step(graphdef, rest, model_cfg, ocfg, tx, shardings, mesh, remat)
    return step, state, abstract_batch(model_cfg, grad_accum, batch, seq, mesh)


def per_device_bytes(tree) -> int:
    """Exact bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


class AotReport(NamedTuple):
    mesh: dict[str, int]
    layers: int
    lower_s: float
    compile_s: float | None  # None: not compiled
    state_bytes: int  # per device, from the shardings
    batch_bytes: int
    memory: dict[str, int] | None  # XLA's memory_analysis() per device, when compiled
    hlo: str | None  # the compiled program's HLO text, when compiled


def lower_and_compile(model_cfg: ModelConfig, ocfg: OptimConfig, mesh, batch: int, seq: int, grad_accum: int = 1,
                      remat: str = "none", compile: bool = True, log=print) -> AotReport:
    """Lower (and compile) the sharded step for ``mesh`` from shapes alone; times each phase."""
    step, state, data = abstract_step(model_cfg, ocfg, mesh, batch, seq, grad_accum, remat)
    t0 = time.perf_counter()
    lowered = step.lower(state, data)
    lower_s = time.perf_counter() - t0
    log(f"lowered in {lower_s:.1f} s")
    compile_s = memory = hlo = None
    if compile:
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        log(f"compiled in {compile_s:.1f} s")
        stats = compiled.memory_analysis()
        memory = None if stats is None else {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in (
            "argument", "output", "alias", "temp", "generated_code")}
        hlo = compiled.as_text()
    return AotReport(dict(mesh.shape), model_cfg.n_layers, lower_s, compile_s, per_device_bytes(state),
                     per_device_bytes(data), memory, hlo)


def format_aot(r: AotReport, p=None) -> str:
    """The report, next to the preflight ``p`` (:class:`~dsv41_jax.train.preflight.Preflight`) if given."""
    gib = 2.0 ** 30
    size = lambda b: f"{b / gib:,.3f} GiB" if b >= gib / 4 else f"{b / 2 ** 20:,.3f} MiB"
    platform = f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    lines = [f"AOT train step for {platform}: mesh {r.mesh}, {r.layers} layers; lowered in {r.lower_s:.1f} s"
             + (f", compiled in {r.compile_s:.1f} s" if r.compile_s is not None else ", not compiled")]
    state = "  per device, exact from the shardings: parameters + router biases + optimizer state + step " + \
        size(r.state_bytes)
    if p is not None:
        pre = round((p.params_gb + p.optimizer_gb) * gib) + 4  # + the int32 step
        state += " (= preflight)" if pre == r.state_bytes else f" (preflight: {size(pre)})"
    lines.append(state + f"; batch {size(r.batch_bytes)}")
    if r.memory is not None:
        m = r.memory
        args = "= state + batch" if m["argument"] == r.state_bytes + r.batch_bytes else "≠ state + batch"
        lines += [f"  per device, XLA memory_analysis: arguments {size(m['argument'])} ({args}), outputs "
                  f"{size(m['output'])} ({size(m['alias'])} aliased to the donated state), "
                  f"temporaries {size(m['temp'])}, generated code {m['generated_code'] / 2 ** 20:,.1f} MiB",
                  f"  temporaries are XLA:{jax.devices()[0].platform.upper()}'s buffer assignment (its fusion and "
                  "scheduling, not a GPU's)" + (f"; the preflight estimates activations at ~{p.activations_gb:,.2f} "
                                                "GiB (H200-calibrated)" if p is not None else "")]
    if r.hlo is not None:
        from dsv41_jax.train.hlo import largest_arrays

        lines.append("  largest arrays the compiled program materialises (per device, outside fusions):")
        lines += [f"    {size(a.bytes):>14s}  {a.type} ×{a.count}  {a.op} at {a.source or '?'}"
                  for a in largest_arrays(r.hlo, 3)]
    return "\n".join(lines)


def aot_train_step(cfg, n_devices: int | None, source: str | None = None, *, compile: bool = True,
                   show_collectives: bool = False, log=print) -> AotReport:
    """``dsv41 train --aot / --collectives``: preflight, then lower (and compile) the run's step from shapes.

    With ``n_devices`` larger than the devices present, this process takes that many fake CPU devices (it must
    not have touched a device yet). The model is ``cfg.model`` as written: a run that trains its tokenizer
    first may adjust ``engram.compressed_vocab_size``, which changes no shape of the step.
    """
    from dsv41_jax.train.config import MESH_AXES
    from dsv41_jax.train.hlo import collectives, format_collectives
    from dsv41_jax.train.preflight import format_preflight, preflight
    from dsv41_jax.train.step import build_mesh

    if n_devices is not None:
        use_fake_cpus(n_devices)
    shape = cfg.mesh.shape(jax.device_count(), source)
    split = math.prod(shape[:3])
    if cfg.data.batch_size % split:
        raise ConfigError(f"{source}: data.batch_size {cfg.data.batch_size} is not divisible by mesh "
                          f"data×fsdp×expert = {split}")
    d = cfg.data
    pre = preflight(cfg.model, cfg.optim, dict(zip(MESH_AXES, shape, strict=True)), d.batch_size, d.seq_len,
                    cfg.remat, cfg.grad_accum)
    log(format_preflight(pre))
    log(f"lowering the train step for {jax.device_count()} {jax.devices()[0].platform} device(s) "
        f"({cfg.grad_accum} × {d.batch_size} × {d.seq_len} tokens, remat {cfg.remat}) ...")
    report = lower_and_compile(cfg.model, cfg.optim, build_mesh(shape), d.batch_size, d.seq_len, cfg.grad_accum,
                               cfg.remat, compile=compile or show_collectives, log=log)
    log(format_aot(report, pre))
    if show_collectives:
        log("collectives of the compiled step (per device; a loop body's collective counts once):")
        log(format_collectives(collectives(report.hlo, jax.device_count())))
    return report
