"""The pre-training loop: config → mesh → tokenizer + data → sharded state → steps → metrics and checkpoints.

Resuming is the default: if the checkpoint directory holds a step, the state and the data iterator continue
from it, so an interrupted run continues to the same losses as an uninterrupted one (fp32, CPU).
:func:`launch` is the whole of ``dsv41 train`` and ``train/pretrain.py``: run config file -> plan or train.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from dsv41_jax.config import ConfigError
from dsv41_jax.data.corpus import open_documents
from dsv41_jax.data.pipeline import DataState, packed_dataset
from dsv41_jax.data.tokenizer import engram_consistent, load_or_train
from dsv41_jax.train.checkpoint import RunCheckpointer, check_writable
from dsv41_jax.train.config import TrainConfig
from dsv41_jax.train.guard import NonFiniteGuard, stopping
from dsv41_jax.train.preflight import check_fits, device_limit_gb, format_preflight, peak_flops, preflight
from dsv41_jax.train.remote import RunMirror, is_uri, local_source, run_directory
from dsv41_jax.train.report import RunReport
from dsv41_jax.train.step import batch_sharding, build_mesh, init_state
from dsv41_jax.train.validation import Validator, hold_out, validator_for


@dataclasses.dataclass
class Run:
    """Everything a run holds between steps (tests drive it step by step)."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    state: object
    step_fn: Callable
    data: DataState
    checkpointer: RunCheckpointer
    model_cfg: object
    dataset: object  # the grain IterDataset behind ``data`` (a new iterator restarts it)
    flops_per_token: float = 0.0  # model FLOPs (forward + backward), for MFU
    evaluate: Callable | None = None  # state -> metrics logged at the end of a run (image–text: caption accuracy)
    validator: Validator | None = None  # val_loss over the held-out documents (validation.documents)

    def next_batch(self, data: DataState | None = None) -> dict:
        """The next optimizer step's global batch [A, B, ...], assembled from every host's rows."""
        local = (data or self.data).next(self.cfg.grad_accum)  # this host's rows: [A, b, ...]
        sharding = batch_sharding(self.mesh)
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def _quiet(_: str) -> None:
    pass


def setup(cfg: TrainConfig, source: str | None = None, log: Callable[[str], None] = print) -> Run:
    """Build (or resume) the run described by ``cfg``; ``source`` names the config file in errors.

    Resumes from the newest checkpoint that restores; a damaged newer one is set aside with a message.
    With several processes (``jax.distributed``) only process 0 logs and trains the tokenizer.
    """
    log = log if jax.process_index() == 0 else _quiet
    mesh = build_mesh(cfg.mesh.shape(jax.device_count(), source))
    per_batch = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    if cfg.data.batch_size % per_batch:
        raise ConfigError(f"{source}: data.batch_size {cfg.data.batch_size} is not divisible by mesh "
                          f"data×fsdp×expert = {per_batch}")
    mirror = None
    if is_uri(cfg.checkpoint.dir):  # the run works in a local mirror and copies finished steps to the URI
        if jax.process_count() > 1:
            raise ConfigError(f"{source}: checkpoint.dir {cfg.checkpoint.dir!r} is a URI, which takes one process; "
                              "several processes write one checkpoint together into a directory they all mount")
        mirror = RunMirror(cfg.checkpoint.dir, log)
        mirror.pull()
        log(f"checkpoint.dir {cfg.checkpoint.dir}: working in {mirror.local}, finished steps are copied there")
    if cfg.posttrain is not None and is_uri(cfg.posttrain.init_from):  # read from its local copy
        init_from = local_source(cfg.posttrain.init_from, "posttrain.init_from", log)
        cfg = cfg.replace(posttrain=dataclasses.replace(cfg.posttrain, init_from=str(init_from)))
    run_dir = run_directory(cfg.checkpoint.dir)
    check_writable(run_dir)  # before the tokenizer, metrics or a checkpoint are written there
    d = cfg.data
    docs = open_documents(d.source, d.paths, d.max_documents, jsonl_key=d.jsonl_key,
                          parquet_column=d.parquet_column)
    docs, held_out = hold_out(docs, cfg.validation.documents) if cfg.validation.documents else (docs, None)
    if cfg.posttrain is not None and d.tokenizer == "train" and jax.process_index() == 0:
        from dsv41_jax.posttrain.recipe import prepare_tokenizer

        prepare_tokenizer(cfg.posttrain.init_from, run_dir)  # a fine-tuning run keeps its source's tokenizer
    train_docs = (docs[i] for i in range(min(d.tokenizer_train_documents, len(docs))))
    if jax.process_count() > 1:  # process 0 trains and writes the tokenizer; the others wait, then read it
        from jax.experimental import multihost_utils

        if jax.process_index() == 0:
            load_or_train(d.tokenizer, run_dir / "tokenizer.json", cfg.model, train_docs)
        multihost_utils.sync_global_devices("dsv41 tokenizer ready")
    tok_path, token_map = load_or_train(d.tokenizer, run_dir / "tokenizer.json", cfg.model, train_docs)
    model_cfg = engram_consistent(cfg.model, token_map)
    held = f" (and {len(held_out)} held out)" if held_out else ""
    log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s); "
        f"{len(docs)} documents{held}; tokenizer {tok_path} (engram.compressed_vocab_size "
        f"{model_cfg.engram.compressed_vocab_size})")
    report = preflight(model_cfg, cfg.optim, dict(mesh.shape), d.batch_size, d.seq_len, cfg.remat, cfg.grad_accum)
    limit = device_limit_gb()
    log(format_preflight(report, limit))
    check_fits(report, limit, source)  # before anything is allocated
    evaluate = None
    if cfg.vision is not None:  # image–text training (dsv41_jax.vision.train)
        from dsv41_jax.vision.train import setup_vision

        state, step_fn, ds, data, evaluate = setup_vision(cfg, model_cfg, mesh, tok_path, token_map, log)
    elif cfg.posttrain is None:
        state, step_fn, _ = init_state(model_cfg, cfg.optim, mesh, cfg.seed, cfg.remat)
        ds = packed_dataset(docs, tok_path, model_cfg, token_map, seq_len=d.seq_len, batch_size=d.batch_size,
                            seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count(),
                            read_threads=d.read_threads, prefetch=d.prefetch, packing=d.packing,
                            packing_bins=d.packing_bins)
        data = DataState(iter(ds))
    else:  # QAT + replay fine-tuning from posttrain.init_from (dsv41_jax.posttrain)
        from dsv41_jax.posttrain.recipe import setup_posttrain

        state, step_fn, ds, data = setup_posttrain(cfg, model_cfg, mesh, tok_path, token_map, docs, log)
    ck = RunCheckpointer(run_dir, cfg.checkpoint.every, cfg.checkpoint.keep, mirror)
    try:
        ck.check_room(state, log)
        resumed = ck.restore_latest(state, log=log, start_fresh=cfg.checkpoint.start_fresh)
    except BaseException:
        ck.close()
        raise
    if resumed is not None:
        step, state, data_state = resumed
        data.restore(data_state)
        log(f"resumed from {ck.dir / str(step)} (step {step})")
    validator = None if held_out is None else validator_for(held_out, tok_path, model_cfg, token_map, cfg, mesh)
    return Run(cfg, mesh, state, step_fn, data, ck, model_cfg, ds, report.flops_per_token, evaluate, validator)


def train(cfg: TrainConfig, source: str | None = None, *, stop_after: int | None = None,
          log: Callable[[str], None] = print, progress: bool | None = None, run: Run | None = None) -> list[dict]:
    """Run to ``cfg.steps`` (or ``stop_after`` more steps); returns the logged metrics.

    Metrics go to the jsonl file, TensorBoard and the console (:mod:`dsv41_jax.train.report`); ``progress``
    (default: when printing to a terminal) redraws a progress line between the logged ones. ``run`` is one
    :func:`setup` already built (tests reuse its compiled step). A non-finite loss (:mod:`.guard`), a failed
    save or a full disk ends the run with :class:`TrainingStopped` once the last save is finished, naming the
    last good checkpoint.
    """
    run = run or setup(cfg, source, log)
    main = jax.process_index() == 0
    history: list[dict] = []
    start = int(run.state.step)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.grad_accum
    peak = peak_flops()  # dense bf16 peak of one device, where known (MFU)
    try:
        report = RunReport(cfg.metrics_path, cfg.tensorboard_dir, end, tokens_per_step, main=main, log=log,
                           progress=progress, resumed=start)
    except BaseException:
        run.checkpointer.close()
        raise
    guard = NonFiniteGuard(cfg.nonfinite, report.log if main else _quiet)
    tick, since = time.perf_counter(), start  # rates count the steps after ``since``, timed from ``tick``
    with stopping(run.checkpointer, report):
        for step in range(start + 1, end + 1):
            if step == start + 1:
                (report.log if main else _quiet)(f"compiling the train step (step {step}) …")
            run.state, metrics = run.step_fn(run.state, run.next_batch())
            report.dispatched(step, metrics)
            if step == start + 1:  # the first call compiles: timed apart, never counted as a training step
                jax.block_until_ready(metrics)
                (report.log if main else _quiet)(f"step {step} compiled and ran in "
                                                  f"{time.perf_counter() - tick:.1f} s")
                tick, since = time.perf_counter(), step
            run.checkpointer.poll()
            validate = run.validator is not None and (step % cfg.validation.every == 0 or step == end)
            if step % cfg.logging.every == 0 or step == end or validate:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                done, took = step - since, now - tick
                m["step"] = step
                if done:  # (a row of the compiling step alone has no rate)
                    m |= {"step_s": took / done, "tokens_per_s": tokens_per_step * done / took}
                    if peak:
                        m["mfu"] = m["tokens_per_s"] * run.flops_per_token / (peak * jax.device_count())
                if validate:  # its time counts in no rate
                    m["val_loss"] = run.validator.loss(run.state)
                tick, since = time.perf_counter(), step
                history.append(m)
                report.record(m, end)
            guard.dispatched(step, metrics)  # after the step's row: a stopping step is in the log
            if run.checkpointer.should_save(step, step == end):
                guard.settle()  # a non-finite step before this one stops the run before anything is saved
                run.checkpointer.save(step, run.state, run.data.state(), dataclasses.asdict(cfg))
        guard.settle()
    if run.evaluate is not None and main and end == cfg.steps:
        scores = run.evaluate(run.state)
        log("end of run: " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        if history:
            history[-1] |= scores
    return history


def losses(history: list[dict]) -> np.ndarray:
    return np.asarray([m["loss"] for m in history])


def launch(config: str, overrides: list[str] | tuple[str, ...] = (), *, stop_after: int | None = None,
           preflight_only: bool = False, aot: bool = False, compile: bool = True, collectives: bool = False,
           devices: int | None = None, log: Callable[[str], None] = print) -> list[dict] | None:
    """``dsv41 train``: the run config file ``config`` with dotted ``key=value`` ``overrides``, then one of

    - ``preflight_only``: log the mesh, per-device memory and model FLOPs for ``devices`` (default: those
      present), from shapes alone;
    - ``aot`` / ``collectives``: lower (and unless not ``compile``, compile) the sharded step from shapes
      (``train.aot.aot_train_step``; more ``devices`` than present are fake CPU devices);
    - otherwise ``jax.distributed`` where configured, then :func:`train` (resuming), returning its metrics.
    """
    from dsv41_jax.config.files import config_path
    from dsv41_jax.train import distributed
    from dsv41_jax.train.config import MESH_AXES, load

    config = str(config_path(config))  # a shipped config by name, from any directory
    cfg = load(config, list(overrides))
    if preflight_only:  # nothing is allocated, so any mesh size can be checked
        mesh = dict(zip(MESH_AXES, cfg.mesh.shape(devices or jax.device_count(), config), strict=True))
        log(format_preflight(preflight(cfg.model, cfg.optim, mesh, cfg.data.batch_size, cfg.data.seq_len,
                                       cfg.remat, cfg.grad_accum)))
        return None
    if aot or collectives:
        from dsv41_jax.train.aot import aot_train_step

        aot_train_step(cfg, devices, config, compile=compile, show_collectives=collectives, log=log)
        return None
    distributed.initialize(cfg.distributed, log=log)  # before anything touches a device
    return train(cfg, source=config, stop_after=stop_after, log=log)
