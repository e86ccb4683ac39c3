"""Shared fixtures: the tiny config (every layer role of the release) and the golden reference data."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jaxtyping import install_import_hook

# XLA's CPU compiles are most of the suite's time; LLVM at -O0 takes a fifth off them and runs these small
# programs as fast (on 2 cores: the engine and golden files 377 -> 315 s, the kernel and training-loop files
# 217 -> 190 s). Codegen may round differently from -O2 in the last bits, so only this process's backend starts
# with it, and the children the tests start compile as a user's process does (the notebook, CLI runs, where
# engine-against-forward comparisons across a QDQ rounding boundary are calibrated), except those that ask for
# -O0 themselves and were checked at it: the fake-device mesh children (``run_on_fake_cpus(fast_compile=True)``)
# and the `dsv41 train` runs of tests/train/test_runs.py.
# (A machine with a CUDA plugin keeps its flags: there the GPU tests run.)
_flags = os.environ.get("XLA_FLAGS")
if not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    os.environ["XLA_FLAGS"] = f"{_flags or ''} --xla_backend_optimization_level=0".strip()
    jax.devices()  # the backend starts now, with the flag
    if _flags is None:
        del os.environ["XLA_FLAGS"]
    else:
        os.environ["XLA_FLAGS"] = _flags

# jaxtyping annotations are checked while the tests run (beartype through jaxtyping's import hook, installed
# before the package is first imported): a shape or dtype annotation that drifts from the code fails the test
# that calls it. The modules listed have had their annotations brought in line with the code; the rest of the
# package joins this list module by module.
TYPECHECKED = ["dsv41_jax.quant", "dsv41_jax.cache", "dsv41_jax.engram_device", "dsv41_jax.optim",
               "dsv41_jax.posttrain", "dsv41_jax.train.step", "dsv41_jax.vision", "pallas_kernels",
               *(f"dsv41_jax.model.{m}" for m in ("attention", "compressor", "documents", "dspark", "engram", "indexer",
                                                  "indexer_loss", "kv_store", "layers", "mhc", "moe", "rope", "sparse",
                                                  "transformer")),
               *(f"dsv41_jax.engine.{m}" for m in ("prefill", "sampling", "speculative", "step"))]
install_import_hook(TYPECHECKED, "dsv41_jax.testing.typechecker")
from dsv41_jax import config as C  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the CLI turns JAX's persistent compilation cache on (~/.cache/dsv41_jax/xla); tests that call it in-process
# leave the user's cache and this process's config alone (tests/test_compile_cache.py covers the cache)
os.environ.setdefault("DSV41_COMPILE_CACHE", "off")
from dsv41_jax.testing import GOLDEN  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # files that hold `slow` tests first: with `-n 2 --dist loadfile` a long file started last would run alone
    # at the end of the suite while the other worker waits
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group is kept
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run this test on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cfg() -> C.ModelConfig:
    """The tiny preset in fp32 activations (the test precision mode)."""
    return C.tiny().replace(dtype="float32")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "tiny_hf" / "config.json").exists():
        pytest.skip(f"golden reference data not found at {GOLDEN} (set DSV41_GOLDEN)")
    return GOLDEN


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def tiny8_cfg(tiny_cfg) -> C.ModelConfig:
    """The tiny preset cut to 8 layers, still one of each role: SWA (0, 1), Full m=2 (2), Reuse m=2 (3),
    Full m=1 candidate source (4), Reuse m=1 (5, 7), Reindex restricted to the candidates (6); Engram at 1 and
    4. About 2/3 of the tiny model's compile time, for tests that compile several programs."""
    a, d = tiny_cfg.attention, tiny_cfg.dspark
    attention = dataclasses.replace(a, compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0), kv_source_layers=(2, 4),
                                    index_source_layers=(2, 4, 6), candidate_source_layer=4)
    return tiny_cfg.replace(n_layers=8, attention=attention, dspark=dataclasses.replace(d, target_layer_ids=(5, 6, 7)))


@pytest.fixture
def gcs_bucket(tmp_path, monkeypatch):
    """``gs://bucket/...`` paths served from a local directory: ``etils.epath``'s backend for the ``gs``
    scheme is swapped for one that maps each URI to ``tmp_path/gcs/...`` (the code under test goes through
    ``epath`` exactly as it would with ``gcsfs``). Yields ``(uri root, local root)``."""
    import glob as glob_lib

    from etils.epath import backend, gpath

    root = tmp_path / "gcs"
    root.mkdir()

    class LocalBucket(backend._OsPathBackend):
        def _local(self, path):
            path = os.fspath(path)
            assert path.startswith("gs://"), path
            return str(root / path[len("gs://"):])

        def _uri(self, path):
            return "gs://" + os.path.relpath(path, root)

        def open(self, path, mode):
            return super().open(self._local(path), mode)

        def glob(self, path):
            return [self._uri(p) for p in glob_lib.glob(self._local(path))]

        def walk(self, top, **kw):
            for d, dirs, files in super().walk(self._local(top), **kw):
                yield self._uri(d), dirs, files

        def rename(self, path, dst):
            return super().rename(self._local(path), self._local(dst))

        def replace(self, path, dst):
            return super().replace(self._local(path), self._local(dst))

        def copy(self, path, dst, overwrite):
            return super().copy(self._local(path), self._local(dst), overwrite)

    for name in ("exists", "isdir", "listdir", "makedirs", "mkdir", "rmtree", "remove", "stat"):
        method = getattr(backend._OsPathBackend, name)
        setattr(LocalBucket, name, lambda self, path, *a, _m=method, **kw: _m(self, self._local(path), *a, **kw))
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", LocalBucket())
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    return "gs://bucket", root / "bucket"
