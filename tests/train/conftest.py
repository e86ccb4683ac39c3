"""Fixtures of the training tests: one compiled run of the tiny model (compiled once per session), and the
8-fake-device child process.

The child (``sharded_child.py``) needs its own process because this one has already initialised JAX with one
device. It starts as soon as collection has selected a test that uses it, so its compiles overlap with the
in-process tests instead of adding to the wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.testing import fake_cpu_env
from dsv41_jax.train.config import from_dict
from dsv41_jax.train.loop import setup

_CHILD = Path(__file__).with_name("sharded_child.py")
_started: dict[str, subprocess.Popen] = {}


def _start_child() -> subprocess.Popen:
    env = fake_cpu_env(8)
    return subprocess.Popen([sys.executable, str(_CHILD)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def pytest_collection_finish(session):
    if any("train_eight_devices" in getattr(item, "fixturenames", ()) for item in session.items):
        _started["child"] = _start_child()


def pytest_sessionfinish(session, exitstatus):
    child = _started.pop("child", None)
    if child is not None and child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(scope="session")
def train_eight_devices() -> dict:
    """The child's JSON report (see ``sharded_child.py``)."""
    child = _started.pop("child", None) or _start_child()
    out, err = child.communicate(timeout=1500)  # three compiles of the step on a busy 2-core machine
    assert child.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(Run, its initial state): the tiny model on 30 embedded documents, 2 × 32 tokens per step."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = from_dict({
        "model": {"preset": "tiny", "dtype": "float32"},
        "optim": {"lr": 2.0e-3, "warmup_steps": 2, "constant_until": 100, "decay_until": 200, "total_steps": 300},
        "data": {"max_documents": 30, "tokenizer_train_documents": 30, "seq_len": 32, "batch_size": 2},
        "checkpoint": {"dir": str(run_dir), "every": 2, "keep": 2},
        "steps": 4,
    }, "tiny_run fixture")
    run = setup(cfg, log=lambda _: None)
    return run, jax.tree.map(jnp.copy, run.state)
