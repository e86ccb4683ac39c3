"""Where a run's metrics go (``dsv41_jax.train.report``): TensorBoard gets the jsonl's scalars, a run without a
writer library says so once, and the terminal progress line shows finished steps, their rate and the ETA."""

from __future__ import annotations

import io
import json
import struct
import sys
import types

import pytest

from dsv41_jax.train import report as R

METRICS = [{"loss": 5.25, "ce": 5.0, "balance": 0.25, "grad_norm": 1.5, "lr": 1e-3, "tokens": 60.0,
            "imbalance": 1.75, "step": 1, "step_s": 2.0, "tokens_per_s": 32.0},
           {"loss": 4.5, "ce": 4.25, "balance": 0.25, "grad_norm": 1.25, "lr": 2e-3, "tokens": 61.0,
            "imbalance": 1.5, "step": 2, "step_s": 0.5, "tokens_per_s": 128.0}]


def _record(tmp_path, lines=None):
    lines = [] if lines is None else lines
    rep = R.RunReport(tmp_path / "metrics.jsonl", tmp_path / "tb", total=4, tokens_per_step=64, log=lines.append,
                      progress=False)
    for m in METRICS:
        rep.record(dict(m), end=4)
    rep.close()
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()], lines


def test_tensorboard_gets_the_jsonl_scalars(tmp_path, monkeypatch):
    """Through the tensorboardX API (a recording stand-in, so this runs wherever the library is missing)."""
    calls = []

    class SummaryWriter:
        def __init__(self, logdir):
            calls.append(("open", logdir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    rows, lines = _record(tmp_path)
    assert rows == METRICS
    assert calls[0] == ("open", str(tmp_path / "tb")) and calls[-1] == ("close",)
    got = {(tag, step): value for tag, value, step in calls[1:-1]}
    assert got == {(k, m["step"]): v for m in METRICS for k, v in m.items() if k != "step"}
    assert lines[0] == f"tensorboard: {tmp_path / 'tb'} (written with tensorboardX)"
    assert lines[-1].startswith("step     2  loss 4.5000") and lines[-1].endswith("[2/4, eta 0m01s]")


def test_without_a_writer_library_the_run_says_so_once(tmp_path, monkeypatch):
    for name in ("tensorboardX", "torch", "tensorflow"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    rows, lines = _record(tmp_path)
    assert rows == METRICS
    assert [x for x in lines if x.startswith("tensorboard")] == [
        "tensorboard: off, no writer library installed (tensorboardX, torch, tensorflow); metrics go to the jsonl "
        "only"]
    assert not (tmp_path / "tb").exists()


def _events(path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in a TensorBoard event file (TFRecord frames of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        event = Event.FromString(data[at + 12:at + 12 + n])  # after the length and its CRC
        at += 12 + n + 4  # the record and its CRC
        out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboardx_event_file_holds_the_jsonl(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed: no event file to read")
    rows, _ = _record(tmp_path)
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    got = {(step, tag): value for step, tag, value in _events(events)}
    want = {(m["step"], k): v for m in rows for k, v in m.items() if k != "step"}
    assert got.keys() == want.keys()
    assert [got[k] for k in want] == pytest.approx(list(want.values()), rel=1e-7)  # stored as float32


class Loss:
    """A stand-in for a device scalar that finishes when the test says so."""

    def __init__(self, value):
        self.value, self.done = value, False

    def is_ready(self):
        return self.done

    def __float__(self):
        return self.value


class Terminal(io.StringIO):
    def screen(self) -> list[str]:
        """What a terminal shows: every ``\\r`` returns to the start of the line, overwriting it."""
        out = []
        for line in self.getvalue().split("\n"):
            shown = ""
            for part in line.split("\r"):
                shown = part + shown[len(part):]
            out.append(shown.rstrip())
        return out


def test_progress_shows_finished_steps_with_rate_and_eta():
    now = [0.0]
    term = Terminal()
    bar = R.Progress(total=10, tokens_per_step=500, stream=term, clock=lambda: now[0], width=10)
    losses = [Loss(10.0 - i) for i in range(10)]
    bar.dispatched(1, losses[0])  # dispatched, not finished: nothing to show yet
    assert term.getvalue() == ""
    losses[0].done, now[0] = True, 30.0  # the first step (compiles) finishes at t = 30 s
    bar.dispatched(2, losses[1])
    assert term.screen() == ["step 1/10 [#---------]  10%  loss 10.0000"]
    bar.dispatched(3, losses[2])
    bar.dispatched(4, losses[3])
    for i in (1, 2, 3):
        losses[i].done = True
    now[0] = 36.0  # steps 2..4 took 6 s: 2 s per step, 250 tokens/s, 6 steps left
    bar.dispatched(5, losses[4])
    assert term.screen() == ["step 4/10 [####------]  40%  loss 7.0000  250 tok/s  eta 0m12s"]
    bar.write("step     4  loss 7.0000 ...")  # a logged line goes above the progress line
    assert term.screen() == ["step     4  loss 7.0000 ...", "step 4/10 [####------]  40%  loss 7.0000  250 tok/s  "
                             "eta 0m12s"]
    bar.close()
    assert term.getvalue().endswith("\n")


def test_progress_is_off_when_not_printing_to_a_terminal(tmp_path):
    rep = R.RunReport(tmp_path / "m.jsonl", None, total=4, tokens_per_step=64, log=print)
    assert rep.progress is None  # pytest captures stdout: not a terminal
    rep.close()


def test_a_logged_step_shows_in_the_progress_line_before_the_log_line(tmp_path):
    term = Terminal()
    rep = R.RunReport(tmp_path / "m.jsonl", None, total=2, tokens_per_step=64, log=print, progress=True)
    rep.progress.stream = term
    rep.dispatched(2, {"loss": Loss(4.5)})  # not finished yet ...
    rep.record(dict(METRICS[1]), end=2)  # ... but fetched for the log
    rep.close()
    assert term.screen() == [R.format_line(METRICS[1], 2), "step 2/2 [####################] 100%  loss 4.5000", ""]
