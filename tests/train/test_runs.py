"""Whole `dsv41 train` runs in child processes (a 4-layer variant of the tiny model, 32-token rows):

- a 2-process ``jax.distributed`` run on localhost (gloo CPU collectives) trains and checkpoints, and its first
  step's cross-entropy equals a plain forward of the initial model over the two hosts' rows put together;
- a damaged newest checkpoint (truncated array file, missing metadata, leftover temporary directory) is
  detected at resume and the previous step is used;
- a run killed with SIGKILL after its first checkpoint and then resumed logs the same losses as an
  uninterrupted run (fp32, CPU);
- ``dsv41 sample --run`` greedy-decodes exactly what the training forward's argmax gives, token by token.

The children share one persistent compilation cache, so only the first of each program compiles.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from dsv41_jax.data.corpus import open_documents
from dsv41_jax.data.pipeline import loss_mask, packed_dataset
from dsv41_jax.data.tokenizer import engram_consistent
from dsv41_jax.engram_hash import EngramHasher, build_token_map
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.train.checkpoint import RunCheckpointer
from dsv41_jax.train.config import load
from dsv41_jax.train.step import init_state, split_model

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pretrain_tiny.yaml"
S, STEPS = 32, 5
OVERRIDES = [  # four layers that still hold every attention role (Full, Reindex, Reuse; ratios 0, 2, 1)
    "model.n_layers=4", "model.attention.compress_ratios=[0,2,1,1,0,0,0]", "model.attention.kv_source_layers=[1,2]",
    "model.attention.index_source_layers=[1,2,3]", "model.attention.candidate_source_layer=2",
    "model.engram.layer_ids=[0,3]", "model.dspark.target_layer_ids=[1,2,3]",
    f"data.seq_len={S}", "data.batch_size=2", "data.max_documents=30", "data.tokenizer_train_documents=30",
    "optim.warmup_steps=2", f"steps={STEPS}", "checkpoint.every=1", "checkpoint.keep=10", "logging.every=1",
]


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra)
    # one CPU device per process; LLVM at -O0: the tiny programs compile faster (the file: 205 -> 180 s)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return env


def _train(run_dir: Path, cache: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv41_jax.cli", "train", "--config", str(CONFIG), *OVERRIDES,
           f"checkpoint.dir={run_dir}", *extra]
    return subprocess.Popen(cmd, env=env or _env(cache), cwd=run_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, what: str, timeout: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout} s; output:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}; output:\n{out[-4000:]}"
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert out.get(m["step"], m["loss"]) == m["loss"], f"step {m['step']} logged twice with different losses"
        out[m["step"]] = m["loss"]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, cache) -> Path:
    """One uninterrupted single-process run: checkpoints 1..STEPS, metrics, tokenizer."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    run_dir.parent.mkdir(exist_ok=True)
    _finish(_train(run_dir, cache), "dsv41 train")
    return run_dir


@pytest.fixture(scope="module")
def run_cfg(cli_run):
    """(TrainConfig, model config as the run used it: Engram map from the run's tokenizer, token map)."""
    cfg = load(CONFIG, OVERRIDES)
    token_map = build_token_map(cli_run / "tokenizer.json")
    return cfg, engram_consistent(cfg.model, token_map), token_map


@pytest.fixture(scope="module")
def forward(run_cfg):
    """Jitted training forward ``(params, biases, tokens [2, S], rows) -> logits`` and the hasher."""
    _, model_cfg, token_map = run_cfg
    graphdef, _, _, rest = split_model(Transformer(model_cfg, rngs=nnx.Rngs(0)))
    fn = jax.jit(lambda params, biases, tokens, rows: nnx.merge(graphdef, params, biases, rest)(tokens, rows))
    return fn, EngramHasher(model_cfg.engram, token_map)


def _logits(forward, params, biases, tokens: np.ndarray) -> np.ndarray:
    fn, hasher = forward
    rows, _ = hasher.row_ids(tokens.astype(np.int64))
    return np.asarray(fn(params, biases, jnp.asarray(tokens, jnp.int32), jnp.asarray(rows, jnp.int32)))


# ----------------------------------------------------------------------------------------------------
# jax.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes each trace and compile the step (~1 min on a busy 2-core CPU)
def test_two_process_run(tmp_path, cache, cli_run, run_cfg, forward):
    run_dir = tmp_path / "run"
    port = _free_port()
    procs = [_train(run_dir, cache, "steps=2", env=_env(cache, DSV41_COORDINATOR=f"127.0.0.1:{port}",
                                                       DSV41_NUM_PROCESSES="2", DSV41_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [_finish(p, f"process {i} of the 2-process run") for i, p in enumerate(procs)]
    assert "jax.distributed: 2 processes" in outs[0] and "'data': 2" in outs[0], outs[0]
    assert "step     2" in outs[0] and "step " not in outs[1], outs  # only process 0 logs
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]  # written once, by process 0

    # process 0 trained the tokenizer alone; BPE training is deterministic, so it is the single run's
    assert (run_dir / "tokenizer.json").read_bytes() == (cli_run / "tokenizer.json").read_bytes()
    cfg, model_cfg, token_map = run_cfg
    docs = open_documents("embedded", (), 30)
    hosts = [iter(packed_dataset(docs, run_dir / "tokenizer.json", model_cfg, token_map, seq_len=S, batch_size=2,
                                 seed=0, process_index=i, process_count=2)) for i in range(2)]
    rows = [next(it) for it in hosts]
    # each checkpoint holds every process's own iterator state
    for step in (1, 2):
        data = json.loads((run_dir / "checkpoints" / str(step) / "data" / "metadata").read_text())
        want_states = [json.loads(json.dumps(it.get_state())) for it in hosts]
        assert data["process_count"] == 2 and data["processes"] == want_states, (data, want_states)
        for it in hosts:
            next(it)

    # oracle: step 1's cross-entropy is the initial model's over both hosts' rows (process order)
    tokens = np.concatenate([r["tokens"] for r in rows])
    seg = np.concatenate([r["segment_ids"] for r in rows])
    _, params, biases, _ = split_model(Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)))
    x = _logits(forward, params, biases, tokens).astype(np.float64)
    x -= x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    mask = loss_mask(seg)[:, :-1]
    want = float((nll * mask).sum() / mask.sum())
    assert abs(metrics[0]["ce"] - want) < 1e-5 * want, (metrics[0]["ce"], want)


# ----------------------------------------------------------------------------------------------------
# checkpoint robustness


def _damage_truncate(step_dir: Path) -> str:
    biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = biggest.stat().st_size
    os.truncate(biggest, size // 2)
    return f"{biggest.relative_to(step_dir)} has {size // 2} bytes, {size} were written"  # checksums.json


def _damage_truncate_unverified(step_dir: Path) -> str:
    (step_dir / "checksums.json").unlink()  # as a step saved before checksums existed
    _damage_truncate(step_dir)
    return "does not restore"


def _damage_metadata(step_dir: Path) -> str:
    (step_dir / "state" / "_METADATA").unlink()
    return "state/_METADATA missing"


@pytest.fixture(scope="module")
def fresh_state(run_cfg):
    cfg, model_cfg, _ = run_cfg
    from dsv41_jax.train.step import build_mesh

    return init_state(model_cfg, cfg.optim, build_mesh((1, 1, 1, 1)), cfg.seed)[0]


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_truncate_unverified, _damage_metadata])
def test_damaged_latest_checkpoint_falls_back(cli_run, fresh_state, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    why = damage(run_dir / "checkpoints" / str(STEPS))
    messages: list[str] = []
    ck = RunCheckpointer(run_dir, every=1, keep=10)
    step, state, data = ck.restore_latest(fresh_state, log=messages.append)
    assert step == STEPS - 1 and int(state.step) == STEPS - 1
    assert len(messages) == 1 and f"checkpoint step {STEPS} " in messages[0] and why in messages[0], messages
    assert (run_dir / "rejected_checkpoints" / str(STEPS)).is_dir()  # set aside, so a resumed run can save it
    assert ck.latest_step() == STEPS - 1
    # what came back is the intact previous step of the untouched run
    good, good_data = RunCheckpointer(cli_run, every=1, keep=10).restore(STEPS - 1, fresh_state)
    assert data == good_data
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(good), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ck.close()


def test_leftover_temporary_directory_is_ignored(cli_run, fresh_state, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    tmp = run_dir / "checkpoints" / f"{STEPS + 1}.orbax-checkpoint-tmp-1234"
    shutil.copytree(run_dir / "checkpoints" / str(STEPS), tmp)
    shutil.rmtree(tmp / "state" / "d")  # a save killed half-way
    messages: list[str] = []
    ck = RunCheckpointer(run_dir, every=1, keep=10)
    step, _, _ = ck.restore_latest(fresh_state, log=messages.append)
    assert step == STEPS and not tmp.exists()
    assert len(messages) == 1 and str(tmp) in messages[0] and "never finished" in messages[0], messages
    ck.close()


@pytest.mark.slow  # two more child processes (compiles come from the shared cache)
def test_kill9_then_resume_gives_the_same_losses(cli_run, cache, tmp_path):
    want = _losses(cli_run)
    assert sorted(want) == list(range(1, STEPS + 1))
    run_dir = tmp_path / "run"
    proc = _train(run_dir, cache)
    first = run_dir / "checkpoints" / "1" / "_CHECKPOINT_METADATA"
    deadline = time.monotonic() + 400
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    finished_early = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert first.exists() and not finished_early, f"the run ended before its first checkpoint:\n{out[-3000:]}"
    assert proc.returncode == -signal.SIGKILL
    done = {int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()}
    assert max(done) < STEPS, f"the kill came after the last checkpoint ({sorted(done)}): nothing to resume"

    out = _finish(_train(run_dir, cache), "the resumed run")
    assert "resumed from" in out, out[-3000:]
    resumed_at = int(out.split("resumed from")[1].split("(step ")[1].split(")")[0])
    got = _losses(run_dir)
    assert resumed_at >= 1 and sorted(got) == list(range(1, STEPS + 1)), (resumed_at, got)
    assert got == want, (resumed_at, got, want)  # bitwise: fp32 on CPU, the same programs and batches


# ----------------------------------------------------------------------------------------------------
# sampling from a training run


def _restore_independently(step_dir: Path):
    """params and biases of a saved TrainState, read with plain Orbax into numpy (not through our loader)."""
    path = step_dir / "state"
    meta = ocp.StandardCheckpointHandler().metadata(path)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta.tree)
    return ocp.PyTreeCheckpointer().restore(path, restore_args=args)


def _fill(like, stored: dict):
    def get(path, _):
        node = stored
        for k in path:
            node = node[str(getattr(k, "key", getattr(k, "name", None)))]
        return jnp.asarray(node)

    return jax.tree_util.tree_map_with_path(get, like)


def test_sample_run_must_be_a_run_directory(tmp_path, capsys):
    from dsv41_jax.cli import main

    assert main(["sample", "--run", str(tmp_path), "--prompt", "x"]) == 2
    assert f"--run {tmp_path}: not a training run directory" in capsys.readouterr().err


def test_sample_from_a_training_run(cli_run, run_cfg, forward, capsys):
    from dsv41_jax.cli import main

    n_new, prompt = 10, "def "
    assert main(["sample", "--run", str(cli_run), "--prompt", prompt, "--max-new-tokens", str(n_new),
                 "--dtype", "float32", "--max-seq-len", "64", "--show-ids"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert f"step {STEPS}" in out, out
    ids_line = [line for line in out.splitlines() if line.startswith("[0] ids ")]
    got = [int(t) for t in ids_line[0][len("[0] ids "):].split(",")]
    assert got, out
    # one prompt streams as text: the prompt, then the continuation as it decodes, then the ids on their own line
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(cli_run / "tokenizer.json")).decode(got, skip_special_tokens=False)
    assert f"\n{prompt}{text}\n[0] ids " in out, out
    assert "compiling prefill and decode (1 row, 10 new tokens) …" in captured.err
    assert "prefill and decode (1 row, 10 new tokens): compiled and ran in " in captured.err

    # oracle: argmax of the full training forward, one token at a time, params read with plain Orbax
    _, model_cfg, _ = run_cfg
    stored = _restore_independently(cli_run / "checkpoints" / str(STEPS))
    _, params, biases, _ = split_model(Transformer(model_cfg, rngs=nnx.Rngs(1)))
    params, biases = _fill(params, stored["params"]), _fill(biases, stored["biases"])
    seq = [model_cfg.bos_token_id, *Tokenizer.from_file(str(cli_run / "tokenizer.json")).encode(
        prompt, add_special_tokens=False).ids]
    want: list[int] = []
    for _ in range(n_new):
        tokens = np.zeros((2, S), np.int64)  # later positions never reach earlier logits (causal)
        tokens[0, : len(seq)] = seq
        logits = _logits(forward, params, biases, tokens)[0, len(seq) - 1]
        nxt = int(np.argmax(logits))
        want.append(nxt)
        if nxt == model_cfg.eos_token_id:
            break
        seq.append(nxt)
    assert got == want, (got, want)
