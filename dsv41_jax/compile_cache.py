"""JAX's persistent compilation cache, on by default for every ``dsv41`` command.

A train step of ``configs/small.yaml`` takes ~340 s to compile on the H200 (BENCHMARKS.md): without a cache a
resumed run, a second ``dsv41 sample`` of the same checkpoint or a re-scored golden pays it again. With it
XLA's compiled programs are written to a directory and read back whenever the same program (same shapes,
shardings, flags and jax version: JAX's own cache key) is compiled again.

The directory is ``--compile-cache DIR`` on the command line, else ``$DSV41_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/dsv41_jax/xla`` (``~/.cache/dsv41_jax/xla``); ``off`` turns it off. Programs that compile in
under a second are not written (JAX's ``jax_persistent_cache_min_compile_time_secs``): they cost more to
read back than to build.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax

ENV = "DSV41_COMPILE_CACHE"
OFF = "off"


def default_dir() -> str:
    """``$DSV41_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/dsv41_jax/xla`` (``~/.cache`` without it)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv41_jax", "xla")


def enable(directory: str | os.PathLike | None = None, *, min_compile_secs: float = 1.0) -> Path | None:
    """Turn the persistent cache on at ``directory`` (None: :func:`default_dir`; ``"off"``: leave it off).

    Returns the directory, or None when off. A directory that cannot be created or written is reported on
    stderr in one line and the command goes on without a cache: a cache must never stop the work.
    """
    directory = default_dir() if directory is None else os.fspath(directory)
    if directory == OFF:
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        print(f"warning: compilation cache off: cannot write {path} ({err.strerror or err})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileNotice:
    """The "compiling …" line before a long first call and its duration after (on stderr, so that a command's
    stdout holds only its output): ``note = CompileNotice("the forward"); ...; note.done()``. The time includes
    the first run; with a warm persistent cache it is mostly that run."""

    def __init__(self, what: str, stream=None):
        self.what, self.stream = what, stream or sys.stderr
        self.t0 = time.monotonic()
        self.pending = True
        print(f"compiling {what} …", file=self.stream, flush=True)

    def done(self) -> None:
        """Report the duration once (later calls do nothing)."""
        if self.pending:
            self.pending = False
            print(f"{self.what}: compiled and ran in {time.monotonic() - self.t0:.1f} s", file=self.stream,
                  flush=True)
