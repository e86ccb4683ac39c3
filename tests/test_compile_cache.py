"""The persistent compilation cache: a second process compiling the same program reads it from disk, and an
unwritable directory turns the cache off with one line instead of stopping the command."""

from __future__ import annotations

import os
import subprocess
import sys

from dsv41_jax import compile_cache

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from dsv41_jax import compile_cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else 0)
compile_cache.enable(sys.argv[1], min_compile_secs=0)
jax.jit(lambda x: jnp.tanh(x @ x.T).sum(-1) * 3).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
print(len(hits))
"""


def _run(directory) -> int:
    """The number of persistent-cache hits of a fresh process compiling PROGRAM's function."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(directory)], check=True, env=env, capture_output=True,
                          text=True)
    return int(done.stdout.split()[-1])


def _entries(directory) -> set[str]:
    return {p.name for p in directory.rglob("*") if p.is_file()}


def test_second_process_reads_the_compiled_program(tmp_path):
    cache = tmp_path / "xla"
    assert _run(cache) == 0
    first = _entries(cache)
    assert first, "the first process wrote nothing to the cache"
    assert _run(cache) == 1  # read back from disk
    assert _entries(cache) == first


def test_unwritable_directory_warns_and_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert compile_cache.enable(blocker / "xla") is None
    assert "compilation cache off: cannot write" in capsys.readouterr().err
    assert compile_cache.enable("off") is None


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "dsv41_jax" / "xla")
