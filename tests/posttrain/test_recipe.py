"""The post-training recipe through the launcher: parameters from a `dsv41 train` run, SFT rows under the
chat template, a few QAT + replay steps that learn with the DSpark drafter kept in step, and resuming from the
run's own checkpoint."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from posttrain_testing import small_model_dict
from tokenizers import Tokenizer

from dsv41_jax.data.corpus import read_documents
from dsv41_jax.data.tokenizer import engram_consistent, train_tokenizer
from dsv41_jax.engram_hash import build_token_map
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.posttrain.config import SFTConfig
from dsv41_jax.posttrain.drafter import run_drafter
from dsv41_jax.posttrain.sft import encode_pair, pairs_from_documents, sft_row, write_pairs
from dsv41_jax.train.checkpoint import RunCheckpointer, model_from_run
from dsv41_jax.train.config import from_dict
from dsv41_jax.train.dspark import load_drafter_npz, save_drafter
from dsv41_jax.train.loop import setup
from dsv41_jax.train.step import build_mesh, init_state

# a one-stage drafter (main_proj and the heads in one stage) keeps its update's compile short
MODEL = small_model_dict() | {"dspark": {"n_layers": 1, "target_layer_ids": [1, 2, 3]}}
MODEL["attention"] = MODEL["attention"] | {"compress_ratios": MODEL["attention"]["compress_ratios"][:5]}
DATA = {"max_documents": 30, "tokenizer_train_documents": 30, "seq_len": 48, "batch_size": 2}
# fewer Newton-Schulz / Sinkhorn iterations: a much smaller step to compile, the same code path
OPTIM = {"lr": 2.0e-3, "warmup_steps": 1, "constant_until": 10, "decay_until": 20, "total_steps": 30,
         "ns_steps": 1, "ns_tail_steps": 0, "sinkhorn_iters": 1}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A pre-training run directory: tokenizer, and one checkpoint (step 5) of a randomly initialised state."""
    run_dir = tmp_path_factory.mktemp("source")
    cfg = from_dict({"model": MODEL, "data": DATA, "checkpoint": {"dir": str(run_dir)}}, "source")
    docs = read_documents("embedded", limit=30)
    tok = train_tokenizer(docs, cfg.model, run_dir / "tokenizer.json")
    model_cfg = engram_consistent(cfg.model, build_token_map(tok))
    state, _, _ = init_state(model_cfg, cfg.optim, build_mesh(cfg.mesh.shape(1)), seed=7)
    ck = RunCheckpointer(run_dir, 1, 1)
    ck.save(5, state, {}, dataclasses.asdict(cfg))
    ck.close()
    pairs = tmp_path_factory.mktemp("sft") / "pairs.jsonl"
    write_pairs(pairs, pairs_from_documents(docs, 16, prompt_lines=4, seed=1))
    save_drafter(DSpark(model_cfg, rngs=nnx.Rngs(3)), run_dir / "drafter.npz")  # DSpark training's output
    return run_dir, state, pairs, docs


def test_chat_template_and_loss_mask(source):
    run_dir, _, _, _ = source
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    cfg = from_dict({"model": MODEL}).model
    sft = SFTConfig()
    ids, n = encode_pair(tok, cfg, sft, "def f(x):", "    return x")
    assert ids[0] == cfg.bos_token_id and ids[-1] == cfg.eos_token_id
    assert tok.decode(ids[1:n].tolist()) == "User: def f(x):\n\nAssistant:"
    assert tok.decode(ids[n:-1].tolist()) == "    return x"
    row = sft_row(ids, n, 32, cfg, None)
    t = np.flatnonzero(row["loss_mask"])
    np.testing.assert_array_equal(row["tokens"][t + 1], ids[n:])  # exactly the response tokens and <eos>
    assert row["segment_ids"].sum() == len(ids) and (row["tokens"][len(ids):] == cfg.pad_token_id).all()
    short = sft_row(ids, n, n, cfg, None)
    assert short is None  # no room for a response token
    cut = sft_row(ids, n, n + 2, cfg, None)  # a long response is cut at the row end
    np.testing.assert_array_equal(np.flatnonzero(cut["loss_mask"]), [n - 1, n])


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_finetune_from_a_run_learns_and_resumes(source, tmp_path):
    """QAT + replay steps from a pre-training run learn and resume; the DSpark drafter (given as a drafter.npz)
    trains alongside: its loss falls, the backbone's update is the plain post-training step's bit for bit, and
    the drafter is part of the checkpoint (resumed with the run, read by sampling from it)."""
    src_dir, src_state, pairs, _ = source
    run_dir = tmp_path / "qat"
    cfg = from_dict({"model": MODEL, "data": DATA, "steps": 4,
                     "optim": OPTIM,
                     "checkpoint": {"dir": str(run_dir), "every": 0},
                     "posttrain": {"init_from": str(src_dir), "sft": {"paths": [str(pairs)]},
                                   "replay": {"prob": 1.0, "granularity": 2},
                                   "drafter": {"init_from": str(src_dir / "drafter.npz"), "lr": 1.0e-2,
                                               "anchors": 32}}}, "qat test")
    run = setup(cfg, log=lambda _: None)
    # the source's parameters and router biases, a fresh optimizer, the source's tokenizer
    for a, b in zip(jax.tree.leaves((run.state.params, run.state.biases)),
                    jax.tree.leaves((src_state.params, src_state.biases)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(run.state.step) == 0
    assert (run_dir / "tokenizer.json").read_bytes() == (src_dir / "tokenizer.json").read_bytes()
    start = load_drafter_npz(src_dir / "drafter.npz", run.model_cfg)
    assert_same(run.state.drafter.params, nnx.split(start, nnx.Param, ...)[1])
    batch = run.next_batch()
    state, losses, drafter_losses = jax.tree.map(jnp.copy, run.state), [], []
    for i in range(4):
        plain = run.step_fn.backbone(jax.tree.map(jnp.copy, state.backbone()), batch)[0] if i == 1 else None
        state, m = run.step_fn(state, batch)
        if plain is not None:  # (the drafter trained once already) its loss moved nothing of the backbone
            assert_same(state.backbone(), plain)
        losses.append(float(m["loss"]))
        drafter_losses.append(float(m["drafter_loss"]))
        assert float(m["hit_frac"]) == 1.0 and float(m["tokens"]) == float(batch["loss_mask"].sum())
        assert float(m["drafter_anchors"]) > 0 and float(m["drafter_skipped"]) == 0.0
    assert np.all(np.diff(losses) < 0), losses
    assert drafter_losses[-1] < 0.9 * drafter_losses[0], drafter_losses
    # resuming reads the run's own checkpoint, not init_from (gone by then)
    run.checkpointer.save(4, state, run.data.state(), dataclasses.asdict(cfg))
    run.checkpointer.close()
    shutil.move(src_dir, src_dir.with_name("moved"))
    try:
        resumed = setup(cfg, log=lambda _: None)
    finally:
        shutil.move(src_dir.with_name("moved"), src_dir)
    assert int(resumed.state.step) == 4
    assert_same((resumed.state.params, resumed.state.drafter), (state.params, state.drafter))
    resumed.checkpointer.close()
    kept = run_drafter(run_dir, run.model_cfg)  # what `dsv41 sample --run --speculative` decodes with
    assert_same(nnx.split(kept, nnx.Param, ...)[1], state.drafter.params)
    model, *_ = model_from_run(run_dir, log=lambda _: None)  # the backbone still restores from such a run
    assert_same(nnx.split(model, nnx.Param, ...)[1], state.params)


def assert_same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
