"""What a run does when a step's loss or gradient norm is not finite (``nonfinite:`` in the run config).

The step itself never applies such an update (:func:`dsv41_jax.train.step.keep_if_not_finite`): the state keeps
its values and the metric ``skipped`` is 1. This module is the loop's side. It looks at every step's flag
without waiting for the device (a flag is read once ``is_ready()``), and waits for all outstanding flags only
before a checkpoint is saved and at the end, so a step with a non-finite loss is always seen before anything
after it is written. Then, by ``nonfinite.action``:

- ``stop`` (the default): training stops with a message naming the step, its loss and gradient norm;
- ``skip``: the batch is dropped with a line saying so, and training goes on; more than
  ``nonfinite.max_skips`` dropped batches in one invocation stop it (a run that keeps diverging).

Either way nothing non-finite is saved, so keep-last-K retention only ever deletes finite checkpoints older
than finite ones.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class NonFiniteConfig:
    action: str = "stop"  # stop | skip
    max_skips: int = 10  # with skip: dropped batches allowed per invocation before the run stops


ACTIONS = ("stop", "skip")


class TrainingStopped(RuntimeError):
    """The run cannot go on (non-finite loss, failed save, full disk); the message says why and what is kept."""


class Preempted(TrainingStopped):
    """A SIGTERM stopped the run after saving the step in progress (``dsv41 train`` exits with 143)."""


class NonFiniteGuard:
    def __init__(self, cfg: NonFiniteConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.pending: deque = deque()  # (step, metrics) not yet looked at
        self.skipped: list[int] = []

    def dispatched(self, step: int, metrics: dict) -> None:
        """Record ``step``'s metrics (device arrays) and look at those already computed, without waiting."""
        self.pending.append((step, metrics))
        while self.pending and _ready(self.pending[0][1]["skipped"]):
            self._check(*self.pending.popleft())

    def settle(self) -> None:
        """Look at every outstanding step (waits for them): before a save, and at the end of the run."""
        while self.pending:
            self._check(*self.pending.popleft())

    def _check(self, step: int, metrics: dict) -> None:
        if float(metrics["skipped"]) == 0.0:
            return
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        bad = " and ".join(n for n, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v))
        what = f"step {step}: {bad or 'loss'} {'are' if ' and ' in bad else 'is'} not finite (loss {loss:.4g}, " \
            f"gradient norm {grad_norm:.4g})"
        if self.cfg.action == "stop":
            self.pending.clear()
            raise TrainingStopped(f"{what}; the update was not applied and training stops "
                                  "(nonfinite.action=stop). Lower optim.lr, or set nonfinite.action=skip to drop "
                                  "such batches")
        self.skipped.append(step)
        if len(self.skipped) > self.cfg.max_skips:
            self.pending.clear()
            raise TrainingStopped(f"{what}: {len(self.skipped)} batches dropped in this run (steps "
                                  f"{_steps(self.skipped)}), more than nonfinite.max_skips = {self.cfg.max_skips}; "
                                  "the run is diverging, lower optim.lr")
        self.log(f"{what}: batch dropped, the state is unchanged ({len(self.skipped)} of at most "
                 f"{self.cfg.max_skips}, nonfinite.action=skip)")


def _ready(x) -> bool:
    return x.is_ready() if hasattr(x, "is_ready") else True


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def state_is_finite(state) -> bool:
    """Whether every float array of ``state`` is finite (one reduction per array, on device; before a save)."""
    return bool(_all_finite(state))


@contextlib.contextmanager
def _sigterm_saves(checkpointer):
    """While the steps run in one process, a SIGTERM sets ``checkpointer.signal`` (the next step is saved and
    the run stops) instead of killing the process. With several processes JAX's preemption service owns the
    signal (``RunCheckpointer.should_save``); off the main thread Python cannot take signals."""
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum, _frame):
        checkpointer.signal = signum

    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stopping(checkpointer, report):
    """Around a run's steps: a SIGTERM saves the step in progress and stops the run (:class:`Preempted`); on
    the way out, whatever ends the steps, close the metrics ``report`` and wait for the ``checkpointer``'s last
    save. A :class:`TrainingStopped` (from the steps or from that last save) comes out as one message that ends
    with where the run would resume."""
    try:
        with _sigterm_saves(checkpointer):
            yield
    except TrainingStopped as err:
        cause = str(err)
        with contextlib.suppress(Exception):
            report.close()
        try:
            checkpointer.close()
        except TrainingStopped as late:
            cause += f"; then {late}"
        raise type(err)(f"{cause}. {_resume_hint(checkpointer)}") from None
    except BaseException:
        with contextlib.suppress(Exception):
            report.close()
        with contextlib.suppress(Exception):
            checkpointer.close()
        raise
    report.close()
    try:
        checkpointer.close()
    except TrainingStopped as err:
        raise TrainingStopped(f"{err}. {_resume_hint(checkpointer)}") from None


def _resume_hint(checkpointer) -> str:
    if checkpointer.good is None:
        return f"No checkpoint of this run is in {checkpointer.dir}: the same command starts again from step 0"
    return f"The last good checkpoint is step {checkpointer.good} at {checkpointer.dir / str(checkpointer.good)}: " \
        "the same command resumes from there"
