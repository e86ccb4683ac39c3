"""Orbax checkpoints of a training run: the TrainState (step, params, router biases, optimizer state), every
process's data iterator state and the run config, every N steps, keep-last-K.

Layout: ``<run>/checkpoints/<step>/{state,data,config}``. ``data`` holds one iterator state per process
(``{"process_count": P, "processes": [state_0, ...]}``): each host reads its own documents, so each resumes
its own iterator; resuming on a different number of processes is refused.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed while saving
leaves the previous good step as the latest one. Saves are asynchronous: training continues while arrays are
written; :meth:`RunCheckpointer.close` waits for the last one.

Resuming (:meth:`RunCheckpointer.restore_latest`) trusts nothing on disk: steps are tried newest first, and a
step that is incomplete (a missing item or metadata file) or does not restore (a truncated or unreadable
array file, bad JSON) is moved to ``<run>/rejected_checkpoints/<step>`` with a message that names the step
and the reason, and the next older step is tried. Leftover temporary directories of interrupted saves are
reported and removed.

Preemption: a SIGTERM (what a scheduler sends before it takes the machines) makes the run save the step in
progress and stop with :class:`Preempted`; the same command resumes there. One process: a signal handler
(:func:`dsv41_jax.train.guard.stopping` installs it) sets a flag read between steps. Several processes: Orbax's
``reached_preemption``, through JAX's preemption sync service (``jax.distributed`` starts it), so that every
process saves the same step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from dsv41_jax.checkpoint import checksums
from dsv41_jax.checkpoint.quiet import quiet_orbax_errors, reason
from dsv41_jax.config import ConfigError
from dsv41_jax.train.guard import Preempted, TrainingStopped, state_is_finite

ITEMS = ("state", "data", "config")
TMP_MARK = ".orbax-checkpoint-tmp"
# files a finalised step must hold (written last by Orbax, so their absence means an incomplete step)
REQUIRED = ("_CHECKPOINT_METADATA", "state/_METADATA", "data/metadata", "config/metadata")


class CheckpointDamaged(RuntimeError):
    """A step directory that cannot be resumed from; the message says why."""


class AllCheckpointsDamaged(ConfigError):
    """Not one step of a run directory restores: the run refuses to start over silently."""


def _gather_json(obj) -> list:
    """``obj`` of every process, in process order (one process: ``[obj]``)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = multihost_utils.process_allgather(np.asarray([raw.size], np.int32))
    padded = np.zeros(int(n.max()), np.uint8)
    padded[: raw.size] = raw
    allraw = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(allraw[i, : int(n[i, 0])]).decode()) for i in range(jax.process_count())]


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class RunCheckpointer:
    def __init__(self, directory: str | Path, every: int, keep: int, mirror=None):
        """``mirror``: a :class:`~dsv41_jax.train.remote.RunMirror` (``directory`` is its local side) that
        receives each confirmed step and, on :meth:`close`, the run's side files."""
        self.run_dir = Path(directory).absolute()
        self.mirror = mirror
        self.dir = self.run_dir / "checkpoints"
        self.every = every
        self.keep = keep
        self.pending: int | None = None  # the step whose asynchronous save is not yet confirmed
        self.good: int | None = None  # the newest step known to be complete on disk
        self.signal: int | None = None  # a SIGTERM that arrived (one process): save the next step, then stop
        self.preempting = False  # the step being finished is the preemption save
        quiet_orbax_errors()
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                               enable_async_checkpointing=True)
        return ocp.CheckpointManager(self.dir, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int, last: bool) -> bool:
        """Whether to save ``step``: the last one, every ``every``, or the one a preemption stops at (asked at
        every step, as JAX's preemption sync point wants on every process)."""
        preempted = self.manager.reached_preemption(step) if jax.process_count() > 1 else self.signal is not None
        self.preempting = preempted and not last  # a run that reached its end just ends
        return last or preempted or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        """Save ``step`` (asynchronously, after the previous save is confirmed); ``data_state`` is this
        process's iterator state. A failure of this save or of the previous one is a :class:`TrainingStopped`."""
        self.wait()
        if not state_is_finite(state):  # the step never applies a non-finite update; this is the last line
            raise TrainingStopped(f"the train state of step {step} holds NaN or inf values; it was not saved")
        data = {"process_count": jax.process_count(), "processes": _gather_json(data_state)}
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(json.loads(json.dumps(config, default=str)))))
        except Exception as err:
            raise self._failed(step, err) from err
        self.pending = step
        if self.preempting:
            self.wait()
            raise Preempted(f"preempted (SIGTERM): step {step} is saved and training stops")

    def poll(self) -> None:
        """Between steps, without waiting: confirm a save that has finished, or raise its failure."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the outstanding save; then record its checksums and take it as the last good step."""
        step, self.pending = self.pending, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            raise self._failed(step, err) from err
        if jax.process_index() == 0:
            try:
                checksums.write(self.dir / str(step))
            except OSError as err:
                raise self._failed(step, err) from err
        self.good = step
        if self.mirror is not None:
            try:
                self.mirror.push(step)
            except Exception as err:  # network, credentials, quota: the step is safe locally, the URI is behind
                raise TrainingStopped(f"copying checkpoint step {step} to {self.mirror.uri} failed ({reason(err)}); "
                                      f"the step is saved in {self.dir / str(step)}, and the same command resumes "
                                      "from it and copies the next steps") from err

    def _failed(self, step: int, err: BaseException) -> TrainingStopped:
        return TrainingStopped(f"saving checkpoint step {step} to {self.dir} failed ({reason(err)}): free "
                               "space or fix the directory")

    def check_room(self, state, log: Callable[[str], None] = print) -> None:
        """Refuse a run whose checkpoint directory lacks room for one checkpoint of ``state`` (its arrays'
        bytes); say so when it has room for fewer than ``keep`` + 1."""
        need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        check_writable(self.dir)
        free = shutil.disk_usage(self.dir).free
        if free < need:
            raise ConfigError(f"checkpoint.dir {self.run_dir}: {free / 2**20:,.1f} MiB free, but one checkpoint of "
                              f"this run takes about {need / 2**20:,.1f} MiB; free space or choose another "
                              "checkpoint.dir")
        if free < need * (self.keep + 1):
            log(f"warning: {self.dir} has room for about {free // max(need, 1)} checkpoints of "
                f"{need / 2**20:,.1f} MiB; checkpoint.keep is {self.keep}, plus one being written")

    def restore(self, step: int, like) -> tuple[object, dict]:
        """The TrainState of ``step`` placed like ``like`` (any mesh: Orbax reshards), and this process's
        data iterator state. Raises :class:`CheckpointDamaged` when the step is incomplete or unreadable."""
        missing = [f for f in REQUIRED if not (self.dir / str(step) / f).exists()]
        if missing:
            raise CheckpointDamaged(f"incomplete: {', '.join(missing)} missing")
        changed = checksums.verify(self.dir / str(step))
        if changed:
            raise CheckpointDamaged(changed)
        self._check_same_state(step, like)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            state = jax.block_until_ready(out["state"])
        except Exception as err:  # tensorstore / Orbax / JSON errors: all mean "cannot resume from here"
            root = err
            while root.__cause__ is not None:  # the innermost error names the array and file
                root = root.__cause__
            reason = " ".join(str(root).split())
            raise CheckpointDamaged(f"does not restore: {reason[:500]}") from err
        if not state_is_finite(state):  # saved before non-finite states were refused: a diverged run
            raise CheckpointDamaged("it holds NaN or inf values (saved by a run that diverged)")
        data = out["data"]
        if not isinstance(data, dict) or "processes" not in data:
            raise CheckpointDamaged("the data item is not an iterator state of this format")
        if data.get("process_count") != jax.process_count():
            raise ConfigError(f"checkpoint step {step} holds the data iterators of {data.get('process_count')} "
                             f"processes but this run has {jax.process_count()}: each process reads its own "
                             "documents, so resume with the same number of processes")
        return state, data["processes"][jax.process_index()]

    def _check_same_state(self, step: int, like) -> None:
        """A readable step saved from another model / optimizer config is the user's error, not damage."""
        try:
            tree = ocp.StandardCheckpointHandler().metadata(self.dir / str(step) / "state")
            stored = sorted((tuple(m.shape), np.dtype(m.dtype).name) for m in jax.tree.leaves(tree))
        except Exception as err:
            raise CheckpointDamaged(f"unreadable state metadata: {' '.join(str(err).split())[:300]}") from err
        want = sorted((tuple(x.shape), np.dtype(x.dtype).name) for x in jax.tree.leaves(like))
        if stored != want:
            diff = sorted(set(stored) ^ set(want))[:3]
            raise ConfigError(f"checkpoint step {step} in {self.dir} holds a different train state ({len(stored)} "
                              f"arrays, this run has {len(want)}; e.g. shapes/dtypes {diff} differ): it was "
                              "saved with another model or optimizer config. Resume with that config or use a "
                              "new checkpoint.dir")

    def restore_latest(self, like, log: Callable[[str], None] = print, *, read_only: bool = False,
                       start_fresh: bool = False) -> tuple[int, object, dict] | None:
        """(step, state, data state) of the newest step that restores, or None when there is no step.

        Damaged steps are moved aside (by process 0) with a message naming the step and the reason;
        ``read_only`` only skips them (and leaves temporary directories alone). When every step is damaged
        nothing is moved and :class:`AllCheckpointsDamaged` is raised, unless ``start_fresh`` (then they are
        moved aside and None is returned: the run starts from step 0)."""
        if not read_only:
            self._drop_tmp(log)
        steps = sorted(self.manager.all_steps(), reverse=True)
        damaged: dict[int, str] = {}
        for step in steps:
            try:
                state, data = self.restore(step, like)
            except CheckpointDamaged as err:
                damaged[step] = str(err)
                continue
            for bad, why in damaged.items():
                where = "skipped" if read_only else f"moved to {self._reject(bad)}"
                log(f"checkpoint step {bad} at {self.dir / str(bad)} is damaged ({why}); {where}, using step {step}")
            self.good = step
            return step, state, data
        if damaged and not start_fresh:
            raise AllCheckpointsDamaged(self._all_damaged(damaged))
        for bad, why in damaged.items():
            log(f"checkpoint step {bad} is damaged ({why}); moved to {self._reject(bad)}")
        if damaged:
            log(f"every checkpoint in {self.dir} was damaged: starting from step 0 (checkpoint.start_fresh)")
        return None

    def _all_damaged(self, damaged: dict[int, str]) -> str:
        newest = max(damaged)
        others = f" (also damaged: step {', '.join(map(str, sorted(damaged)[:-1]))})" if len(damaged) > 1 else ""
        return (f"every checkpoint in {self.dir} is damaged: step {newest}: {damaged[newest]}{others}. Nothing was "
                "changed. To start over from step 0 anyway, rerun with checkpoint.start_fresh=true (the damaged "
                "steps move to rejected_checkpoints/), or use a new checkpoint.dir")

    def run_config(self, step: int) -> dict:
        """The run config saved with ``step`` (the ``TrainConfig`` as a dict)."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception as err:
            raise CheckpointDamaged(f"its config item does not read: {' '.join(str(err).split())[:300]}") from err

    def _reject(self, step: int) -> Path:
        dest = self.run_dir / "rejected_checkpoints" / str(step)
        if jax.process_index() == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                dest = dest.with_name(f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(self.dir / str(step)), dest)
        _sync(f"dsv41 rejected step {step}")
        self.manager.reload()
        return dest

    def _drop_tmp(self, log: Callable[[str], None]) -> None:
        leftovers = sorted(p for p in self.dir.glob(f"*{TMP_MARK}*") if p.is_dir()) if self.dir.exists() else []
        for path in leftovers:
            log(f"removing {path}: a save that never finished (the process stopped while writing it)")
            if jax.process_index() == 0:
                shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            _sync("dsv41 tmp checkpoints removed")
            self.manager.reload()

    def close(self) -> None:
        """Wait for the last save (its failure is raised after the manager is closed), close the manager and
        copy the side files (metrics) to the mirror's URI."""
        failed = True
        try:
            self.wait()
            failed = False
        finally:
            try:
                self.manager.close()
            except Exception:  # a failed save was already raised by wait(); closing must not hide it
                pass
            if self.mirror is not None:
                try:
                    self.mirror.push()
                except Exception as err:
                    if not failed:  # else the save's failure is what the user must see
                        raise TrainingStopped(f"copying the run's metrics to {self.mirror.uri} failed "
                                              f"({reason(err)}); they are in {self.run_dir}") from err


def check_writable(directory: str | Path) -> None:
    """Create ``directory`` and write a file into it, or raise a ConfigError that says why not."""
    directory = Path(directory)
    probe = directory / f".dsv41-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"checkpoint.dir: cannot write into {directory} ({reason(err)}); choose another "
                          "checkpoint.dir") from err


def model_from_run(run_dir: str | Path, dtype: str = "float32", log: Callable[[str], None] = print):
    """(model, Engram hasher, tokenizer path, step) of the newest good checkpoint of a ``dsv41 train`` run.

    The model config is the one saved with that step (its ``model`` section) with ``engram.compressed_vocab_size``
    taken from the run's ``tokenizer.json``, as training did; ``dtype`` sets the activation precision only.
    The parameters and router biases come from the step's TrainState (the optimizer state, and the drafter a
    post-training run kept in step, are read and dropped). Damaged steps are skipped with a message and left in
    place. Nothing usable is a ConfigError.
    """
    from flax import nnx

    from dsv41_jax import config as C
    from dsv41_jax.data.tokenizer import engram_consistent
    from dsv41_jax.engram_hash import EngramHasher, build_token_map
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.optim import from_dict as optim_from_dict
    from dsv41_jax.optim import optimizer
    from dsv41_jax.posttrain.drafter import PosttrainState, abstract_drafter_state, stored_drafter
    from dsv41_jax.train.remote import local_run
    from dsv41_jax.train.step import TrainState, split_model

    run = local_run(run_dir, log)  # a run at a URI: its mirror, with what it lacks copied down
    tok = run / "tokenizer.json"
    if not tok.is_file() or not (run / "checkpoints").is_dir():
        raise ConfigError(f"--run {run}: not a training run directory (expected tokenizer.json and "
                          "checkpoints/<step>/ as `dsv41 train` writes them)")
    ck = RunCheckpointer(run, every=0, keep=1 << 30)
    token_map = build_token_map(tok)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
        for step in sorted(ck.manager.all_steps(), reverse=True):
            try:
                saved = ck.run_config(step)
            except CheckpointDamaged as err:
                log(f"checkpoint step {step} at {ck.dir / str(step)} is damaged ({err}); trying the previous step")
                continue
            source = f"{ck.dir / str(step)} (saved run config)"
            cfg = C.from_dict(saved["model"], source).replace(dtype=dtype)
            cfg = engram_consistent(cfg, token_map)
            ocfg = optim_from_dict(saved["optim"], source)
            if saved.get("vision") is not None:  # an image–text run: the backbone with its vision tower
                from dsv41_jax.vision.config import from_dict as vision_from_dict
                from dsv41_jax.vision.train import abstract_vision_model, vision_optimizer

                model, tx = abstract_vision_model(cfg), vision_optimizer(cfg, ocfg, vision_from_dict(saved["vision"]))
            else:
                model, tx = abstract_model(cfg), optimizer(cfg, ocfg)
            graphdef, params, biases, rest = split_model(model)
            opt_state = jax.eval_shape(tx.init, params)
            like = TrainState(jax.ShapeDtypeStruct((), np.int32), params, biases, opt_state)
            if stored_drafter(ck.dir / str(step)):  # a post-training run that kept its drafter in step
                from dsv41_jax.posttrain.config import from_dict as posttrain_from_dict

                like = PosttrainState(*like, abstract_drafter_state(cfg, ocfg, posttrain_from_dict(
                    saved["posttrain"], source).drafter))
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
            try:
                state, _ = ck.restore(step, like)
            except CheckpointDamaged as err:
                log(f"checkpoint step {step} at {ck.dir / str(step)} is damaged ({err}); trying the previous step")
                continue
            model = nnx.merge(graphdef, state.params, state.biases, rest)
            return model, EngramHasher(cfg.engram, token_map), tok, step
    finally:
        ck.manager.close()
    raise ConfigError(f"--run {run}: no checkpoint under {ck.dir} restores")
