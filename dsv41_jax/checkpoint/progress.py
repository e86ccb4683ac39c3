"""A one-line progress report in bytes with throughput and ETA, for long streaming jobs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


class Progress:
    """``advance(n, label)`` after each piece of work; prints at most every ``interval`` seconds.

    On a terminal the line is redrawn in place; otherwise one line per report (logs stay readable).
    Bytes already done before this run (a resumed job) count towards the fraction, not the throughput.
    """

    def __init__(self, total: int, done: int = 0, *, stream: TextIO | None = None, enabled: bool = True,
                 interval: float | None = None, prefix: str = "convert"):
        self.total, self.done, self.start_done = total, done, done
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.5 if self.tty else 10.0)
        self.enabled, self.prefix = enabled, prefix
        self.t0 = time.monotonic()
        self._last = self.t0  # the first report comes after one interval, when the rate means something

    def line(self, label: str = "") -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        left = self.total - self.done
        eta = human_seconds(left / rate) if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.prefix} {human_bytes(self.done)} / {human_bytes(self.total)} {pct:5.1f}%  "
                f"{human_bytes(rate)}/s  ETA {eta}  {label}")

    def advance(self, nbytes: float, label: str = "") -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            end = "\r" if self.tty else "\n"
            self.stream.write(self.line(label)[:160].ljust(160 if self.tty else 0) + end)
            self.stream.flush()

    def finish(self, message: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + message + "\n")
            self.stream.flush()
