"""The training loop on one CPU: the loss falls on a fixed batch, a run resumed from an Orbax checkpoint
(state + router biases + optimizer + data iterator) continues to the same losses as an uninterrupted run, and a
run whose checkpoint.dir is a URI works in a local mirror and resumes from the URI. The tests share one compiled
step (``tiny_run``)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import ConfigError
from dsv41_jax.data.pipeline import DataState
from dsv41_jax.train import remote
from dsv41_jax.train.checkpoint import RunCheckpointer, model_from_run
from dsv41_jax.train.loop import setup, train
from dsv41_jax.train.plot import metrics_path


def copy_state(state):
    return jax.tree.map(jnp.copy, state)  # the step donates its input state


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_loss_decreases_on_a_fixed_batch(tiny_run):
    run, fresh = tiny_run
    batch = run.next_batch(DataState(iter(run.dataset)))
    state, losses, biases0 = copy_state(fresh), [], jax.tree.leaves(fresh.biases)
    for _ in range(5):
        state, m = run.step_fn(state, batch)
        losses.append(float(m["loss"]))
        assert np.isfinite(float(m["grad_norm"])) and float(m["balance"]) > 0
    assert np.all(np.diff(losses) < 0), losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert int(state.step) == 5
    # the aux-loss-free rule moved the text biases only (no image tokens), spec model §5.3
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
             zip(jax.tree.leaves(state.biases), biases0, strict=True)]
    assert max(moved) > 0


def _losses(run, state, data, n):
    out = []
    for _ in range(n):
        state, m = run.step_fn(state, run.next_batch(data))
        out.append(float(m["loss"]))
    return state, out


def test_resume_continues_the_same_run(tiny_run):
    run, fresh = tiny_run
    ck = run.checkpointer
    data = DataState(iter(run.dataset))
    state, first = _losses(run, copy_state(fresh), data, 2)
    ck.save(2, state, data.state(), {"note": "test"})
    ck.manager.wait_until_finished()
    _, want = _losses(run, state, data, 3)  # the uninterrupted run

    resumed_data = DataState(iter(run.dataset))  # a new process would start here
    restored, data_state = ck.restore(ck.latest_step(), fresh)
    resumed_data.restore(data_state)
    assert int(restored.step) == 2
    _, got = _losses(run, restored, resumed_data, 3)
    assert got == want, (first, want, got)  # fp32 on CPU: bitwise the same steps


def test_run_at_a_uri_copies_steps_and_resumes_from_them(tiny_run, gcs_bucket, tmp_path, monkeypatch):
    """checkpoint.dir ``gs://bucket/run`` (served from a local directory through ``etils.epath``): the run works
    in its mirror and copies each confirmed step (marker last), the tokenizer and the metrics there, keep-last-K
    included; a machine with an empty mirror copies the complete steps down and resumes; ``--run URI`` loads."""
    base, fresh = tiny_run
    uri, bucket = gcs_bucket
    monkeypatch.setenv("DSV41_RUN_MIRROR", str(tmp_path / "mirror"))
    cfg = dataclasses.replace(base.cfg, steps=3, logging=dataclasses.replace(base.cfg.logging, tensorboard=None),
                              checkpoint=dataclasses.replace(base.cfg.checkpoint, dir=f"{uri}/run", every=1, keep=2))
    mirror = tmp_path / "mirror" / "gs" / "bucket" / "run"
    assert cfg.run_dir == mirror and cfg.metrics_path == mirror / "metrics.jsonl"
    link = remote.RunMirror(cfg.checkpoint.dir)
    link.pull()  # nothing there yet
    shutil.copy(base.cfg.run_dir / "tokenizer.json", mirror / "tokenizer.json")  # as setup() would have trained it
    run = dataclasses.replace(base, cfg=cfg, state=copy_state(fresh), data=DataState(iter(base.dataset)),
                              checkpointer=RunCheckpointer(mirror, 1, 2, link))  # tiny_run's compiled step
    history = train(cfg, log=lambda _: None, run=run)
    assert [m["step"] for m in history] == [1, 2, 3]

    there = bucket / "run"
    assert sorted(p.name for p in (there / "checkpoints").iterdir()) == ["2", "3"]  # keep-last-2 there too
    for step in ("2", "3"):  # every file of the step, byte for byte, then the marker
        files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*")  # noqa: E731
                              if p.is_file() and p.name != remote.MARK}
        assert files(mirror / "checkpoints" / step) == files(there / "checkpoints" / step)
        assert (there / "checkpoints" / step / remote.MARK).is_file()
    assert [json.loads(line)["step"] for line in (there / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (there / "tokenizer.json").read_bytes() == (mirror / "tokenizer.json").read_bytes()

    # a new machine: nothing local. An upload cut off before its marker is not taken for a finished step.
    shutil.rmtree(tmp_path / "mirror")
    shutil.copytree(there / "checkpoints" / "3", there / "checkpoints" / "4")
    (there / "checkpoints" / "4" / remote.MARK).unlink()
    messages = []
    resumed = setup(dataclasses.replace(cfg, steps=5), log=messages.append)
    resumed.checkpointer.close()
    assert int(resumed.state.step) == 3 and any("never finished" in m for m in messages), messages
    assert not (mirror / "checkpoints" / "4").exists() and (mirror / "metrics.jsonl").is_file()
    for got, want in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(run.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the step came down byte for byte

    _, _, tok, step = model_from_run(f"{uri}/run", log=lambda _: None)  # dsv41 sample --run URI
    assert step == 3 and tok == mirror / "tokenizer.json"
    shutil.rmtree(tmp_path / "mirror")  # dsv41 plot --run URI on a third machine
    assert metrics_path(f"{uri}/run") == mirror / "metrics.jsonl" and (mirror / "checkpoints" / "3").is_dir()
    with pytest.raises(ConfigError, match=r"a metrics file at a URI; give the run directory's URI"):
        metrics_path(f"{uri}/run/metrics.jsonl")


def test_run_uri_errors_name_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_RUN_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(ConfigError, match=r"checkpoint\.dir 'gs://bucket/\.\./x'"):
        remote.run_directory("gs://bucket/../x")
    with pytest.raises(ConfigError, match=r"checkpoint\.dir s3://bucket/run: cannot list it .*ImportError"):
        remote.RunMirror("s3://bucket/run").pull()  # no s3 file system installed here
