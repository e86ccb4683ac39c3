"""Where a run's metrics go: the jsonl file, TensorBoard (if a writer library is installed) and the console.

Every logged step becomes one jsonl line and the same scalars in TensorBoard, under the same names. The
TensorBoard writer is the first importable of tensorboardX, ``torch.utils.tensorboard`` and TensorFlow's
``tf.summary``; with none installed the run says so once and writes the jsonl only. On a terminal, a progress
line (step / total, loss, tokens/s, ETA) is redrawn in place between the logged lines; it follows steps as they
finish on the device (``jax.Array.is_ready``) without waiting for them. Off a terminal only the logged lines
are printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any


class _SummaryWriter:
    """tensorboardX and ``torch.utils.tensorboard`` share this API."""

    def __init__(self, cls, logdir: Path):
        self.writer = cls(str(logdir))

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _TfWriter:
    def __init__(self, tf, logdir: Path):
        self.tf, self.writer = tf, tf.summary.create_file_writer(str(logdir))

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        with self.writer.as_default():
            for tag, value in metrics.items():
                self.tf.summary.scalar(tag, value, step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _tensorboardx(logdir):
    from tensorboardX import SummaryWriter

    return _SummaryWriter(SummaryWriter, logdir)


def _torch(logdir):
    from torch.utils.tensorboard import SummaryWriter

    return _SummaryWriter(SummaryWriter, logdir)


def _tensorflow(logdir):
    import tensorflow as tf

    return _TfWriter(tf, logdir)


WRITERS = {"tensorboardX": _tensorboardx, "torch": _torch, "tensorflow": _tensorflow}


def tensorboard_writer(logdir: Path, log: Callable[[str], None] = print):
    """A TensorBoard scalar writer into ``logdir`` from the first installed library of ``WRITERS``, or None."""
    for name, make in WRITERS.items():
        try:
            writer = make(logdir)
        except ImportError:
            continue
        log(f"tensorboard: {logdir} (written with {name})")
        return writer
    log(f"tensorboard: off, no writer library installed ({', '.join(WRITERS)}); metrics go to the jsonl only")
    return None


class Progress:
    """A console line redrawn in place: ``step 120/300 [######----] 40%  loss 3.2140  5,210 tok/s  eta 1m02s``.

    :meth:`dispatched` is called after each step is dispatched, with that step's loss (a device array). Steps
    are shown once finished: pending losses are polled with ``is_ready()``, so the loop never waits for them.
    The rate and ETA come from the finish times seen so far (the first step, which compiles, is left out).
    """

    def __init__(self, total: int, tokens_per_step: int, stream=None, clock=time.perf_counter, width: int = 20):
        self.total, self.tokens, self.width, self.clock = total, tokens_per_step, width, clock
        self.stream = stream or sys.stdout
        self.pending: deque = deque()
        self.first: tuple[int, float] | None = None  # (step, time) of the first finish seen
        self.shown = ""
        self.drawn = 0.0

    def dispatched(self, step: int, loss: Any) -> None:
        self.pending.append((step, loss))
        done = None
        while self.pending and _ready(self.pending[0][1]):
            done = self.pending.popleft()
        if done is not None:
            self._finished(*done)

    def synced(self, step: int, loss: float) -> None:
        """``step`` is known to have finished (its metrics were fetched): show it now."""
        while self.pending and self.pending[0][0] <= step:
            self.pending.popleft()
        self._finished(step, loss, force=True)

    def _finished(self, step: int, loss, force: bool = False) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        if force or now - self.drawn >= 0.1 or step == self.total:  # at most ten redraws a second
            self.drawn = now
            self._draw(self.line(step, float(loss), now))

    def line(self, step: int, loss: float, now: float) -> str:
        frac = step / max(self.total, 1)
        fill = int(round(frac * self.width))
        text = f"step {step}/{self.total} [{'#' * fill}{'-' * (self.width - fill)}] {frac:4.0%}  loss {loss:.4f}"
        s0, t0 = self.first
        if step > s0 and now > t0:
            per_step = (now - t0) / (step - s0)
            text += f"  {self.tokens / per_step:,.0f} tok/s  eta {duration(per_step * (self.total - step))}"
        return text

    def write(self, text: str) -> None:
        """A permanent line above the progress line."""
        shown = self.shown
        self._draw("")
        print(text, file=self.stream, flush=True)
        self._draw(shown)

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""

    def _draw(self, text: str) -> None:
        if text or self.shown:
            blank = "\r" + " " * len(self.shown) if len(text) < len(self.shown) else ""
            self.stream.write(blank + "\r" + text)
            self.stream.flush()
        self.shown = text


def _ready(x) -> bool:
    return x.is_ready() if hasattr(x, "is_ready") else True


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class RunReport:
    """The jsonl sink, the TensorBoard writer and the console of one run (process 0 only writes anything).

    The jsonl holds one timeline: a run resumed at step ``resumed`` first drops the rows after that step (they
    were logged by the interrupted run and are logged again) and a torn last line (a full disk, a kill while
    writing). Each row is written whole or not at all: a failed write is cut back off the file and stops the
    run (:class:`~dsv41_jax.train.guard.TrainingStopped`)."""

    def __init__(self, jsonl: Path, tensorboard: Path | None, total: int, tokens_per_step: int, *, main: bool = True,
                 log: Callable[[str], None] = print, progress: bool | None = None, resumed: int = 0):
        self.main = main
        self.sink = None
        self.writer = self.progress = None
        self.log = log
        if not main:
            return
        self.path, self.tensorboard = jsonl, tensorboard
        try:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            dropped = truncate_metrics(jsonl, resumed)
            self.sink = jsonl.open("ab")
        except OSError as err:
            raise _stopped(jsonl, err) from err
        if dropped:
            log(f"{jsonl}: dropped {dropped} row(s) after step {resumed}, where this run resumes")
        if tensorboard is not None:
            self.writer = tensorboard_writer(tensorboard, log)
        if progress is None:
            progress = log is print and sys.stdout.isatty()
        self.progress = Progress(total, tokens_per_step) if progress else None
        self.log = self.progress.write if self.progress else log

    def dispatched(self, step: int, metrics: dict) -> None:
        if self.progress is not None:
            self.progress.dispatched(step, metrics["loss"])

    def record(self, m: dict[str, float], end: int) -> None:
        """One logged step of a run to step ``end``: ``m`` holds floats and ``step``."""
        if not self.main:
            return
        if self.progress is not None:
            self.progress.synced(m["step"], m["loss"])
        self._write((json.dumps(m) + "\n").encode())
        if self.writer is not None:
            try:
                self.writer.scalars(m["step"], {k: v for k, v in m.items() if k != "step"})
            except OSError as err:
                raise _stopped(self.tensorboard, err) from err
        self.log(format_line(m, end))

    def _write(self, line: bytes) -> None:
        end = self.sink.tell()
        try:
            self.sink.write(line)
            self.sink.flush()
        except OSError as err:
            with contextlib.suppress(OSError):
                os.truncate(self.path, end)  # no torn row for the next run to merge with
            raise _stopped(self.path, err) from err

    def close(self) -> None:
        parts, self.progress, self.writer, self.sink = (self.progress, self.writer, self.sink), None, None, None
        for part in parts:
            if part is not None:
                with contextlib.suppress(OSError):
                    part.close()


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the rows of ``path`` up to step ``last_step``, whole lines only; returns how many were dropped."""
    if not path.exists():
        return 0
    keep: list[tuple[int, bytes]] = []
    lines = path.read_bytes().splitlines(keepends=True)
    for line in lines:
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step):
            continue
        while keep and keep[-1][0] >= row["step"]:  # a later resume logged this step again: it wins
            keep.pop()
        keep.append((row["step"], line))
    dropped = len(lines) - len(keep)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(line for _, line in keep))
        os.replace(tmp, path)
    return dropped


def _stopped(path: Path, err: OSError):
    from dsv41_jax.train.guard import TrainingStopped

    return TrainingStopped(f"cannot write the metrics to {path} ({err.strerror or err}): free space or fix the "
                           "directory")


def format_line(m: dict[str, float], end: int) -> str:
    """One logged row; the first step's row alone (it compiled) has no rate or ETA."""
    text = (f"step {m['step']:5d}  loss {m['loss']:.4f}  ce {m['ce']:.4f}  bal {m['balance']:.2e}  "
            f"|g| {m['grad_norm']:.3f}  lr {m['lr']:.2e}  imb {m['imbalance']:.2f}"
            + (f"  val {m['val_loss']:.4f}" if "val_loss" in m else ""))
    if "step_s" not in m:
        return text + f"  [{m['step']}/{end}]"
    return (text + f"  {m['tokens_per_s']:.0f} tok/s  {m['step_s']:.2f} s/step"
            + (f"  MFU {m['mfu']:.1%}" if "mfu" in m else "")
            + f"  [{m['step']}/{end}, eta {duration(m['step_s'] * (end - m['step']))}]")
