"""Failures of Orbax and tensorstore reads and writes as one line: the innermost cause of an error
(:func:`reason`), and filters that keep their tracebacks off the console (:func:`quiet_orbax_errors`): a failed
save or restore otherwise prints tracebacks from several threads and, for a few damaged steps, tens of thousands
of "Event loop is closed" lines from tasks that finish after their event loop. The callers report the failure
themselves, naming the step or the file.
"""

from __future__ import annotations

import logging
import re
import sys


def reason(err: BaseException) -> str:
    """The innermost cause of ``err`` on one line (it names the file and the OS error)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split()) or type(err).__name__
    text = re.sub(r" \[(tensorstore_spec|source locations)=.*?\](?= \[|$)", "", text)  # specs: kilobytes of JSON
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-200:]}"  # the OS error is at the end


def _from_orbax(tb) -> bool:
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a failed save or restore with full tracebacks from several threads, and asyncio logs the
    tasks it left behind; RunCheckpointer reports the failure itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[2] if record.exc_info else None
        return not ("orbax" in record.pathname or _from_orbax(exc))


def _quiet_unraisable(hook):
    """The tasks of a failed Orbax read finish after their event loop is closed, each printing a traceback
    ("Event loop is closed", "Exception ignored in <coroutine ...>"): tens of thousands of lines for a few
    damaged steps. Only those are dropped."""

    def quiet(unraisable) -> None:
        exc, obj = unraisable.exc_value, unraisable.object
        code = getattr(obj, "cr_code", None)
        if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed") or _from_orbax(
                unraisable.exc_traceback) or (code is not None and "orbax" in code.co_filename):
            return
        hook(unraisable)

    quiet.dsv41 = True
    return quiet


def quiet_orbax_errors() -> None:
    """Install the filters above once per process (the absl and asyncio loggers, ``sys.unraisablehook``)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
            logger.addFilter(_DropOrbaxErrors())
    if not getattr(sys.unraisablehook, "dsv41", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
