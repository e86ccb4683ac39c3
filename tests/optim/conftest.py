"""Fixtures of the optimizer tests: the abstract release model, and the 8-fake-device child process.

The child (``sharded_child.py``) needs its own process because this one has already initialised JAX with one
device. It is started as soon as collection has selected a test that uses it, so its compiles run on the
second CPU core while the in-process tests run, instead of adding to the wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_jax import config as C
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.testing import fake_cpu_env

_CHILD = Path(__file__).with_name("sharded_child.py")
_started: dict[str, subprocess.Popen] = {}


def _start_child() -> subprocess.Popen:
    env = fake_cpu_env(8)
    return subprocess.Popen([sys.executable, str(_CHILD)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def pytest_collection_finish(session):
    if any("optim_eight_devices" in getattr(item, "fixturenames", ()) for item in session.items):
        _started["child"] = _start_child()


def pytest_sessionfinish(session, exitstatus):
    child = _started.pop("child", None)
    if child is not None and child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(scope="session")
def optim_eight_devices() -> dict:
    """The child's JSON report (see ``sharded_child.py``)."""
    child = _started.pop("child", None) or _start_child()
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def release_model():
    return abstract_model(C.v41_flash())


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    """Parameters and router biases of the tiny model, shapes only."""
    from dsv41_jax.optim.memory import abstract_params

    return abstract_params(tiny_cfg)
