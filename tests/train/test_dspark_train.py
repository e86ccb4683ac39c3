"""DSpark training: the anchored draft blocks of the training loss are the engine's drafts.

A row of two packed documents on the 8-layer tiny model (random weights). Each anchor's training block (the
window of target keys before it gathered from the whole row, its own document's only) must give the same
logits and confidences as the inference path: the drafter observing that document's target features up to the
anchor in its rings, then drafting the block with the same Markov inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import cache as C
from dsv41_jax.config import ConfigError
from dsv41_jax.model.dspark import DSpark, init_draft_cache
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.train.dspark import anchored_drafts, load_config, pick_anchors

REPO = Path(__file__).resolve().parents[2]


def test_training_blocks_are_the_engines_drafts(tiny8_cfg):
    # one stage (it owns main_proj and the heads): what is checked is each block's window and mask
    a = tiny8_cfg.attention
    cfg = tiny8_cfg.replace(dspark=dataclasses.replace(tiny8_cfg.dspark, n_layers=1),
                            attention=dataclasses.replace(a, compress_ratios=a.compress_ratios[:9]))
    target, drafter = Transformer(cfg, rngs=nnx.Rngs(0)), DSpark(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    n1, n2 = 14, 10  # two documents in one row; the second starts at position 0 again
    tokens = jnp.asarray(rng.integers(4, 500, (1, n1 + n2)), jnp.int32)
    seg = jnp.asarray([[1] * n1 + [2] * n2], jnp.int32)
    pos = jnp.asarray([list(range(n1)) + list(range(n2))], jnp.int32)
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos}
    # the target's features as both paths read them (their values do not matter here: the blocks are compared)
    main_hidden = jnp.asarray(rng.normal(size=(1, n1 + n2, 3 * cfg.dim)), jnp.float32)
    anchors = jnp.asarray([[2, 7, n1 + 3]], jnp.int32)  # a partial window, a full one, one in document 2
    logits, conf, block = jax.jit(lambda p: anchored_drafts(drafter, target, batch, main_hidden, p))(anchors)
    k = cfg.dspark.block_size

    @jax.jit
    def engine(p, j):
        """The drafter shown the anchor's document up to the anchor (one row), then drafting its block."""
        seen = (seg[0] == seg[0, p]) & (jnp.arange(n1 + n2) <= p)
        cache = drafter.observe(init_draft_cache(cfg, 1), main_hidden, pos, seen[None])
        keys = tuple(C.read_ring(r, jnp.float32) for r in cache.rings)
        h, base = drafter.block(target, block[:, j, 0], cache.lengths, keys,
                                C.ring_positions(cache.lengths, cfg.attention.window_size))
        return drafter.heads(base, h, block[:, j, :k])

    for j, p in enumerate(np.asarray(anchors[0])):
        want_logits, want_conf = engine(jnp.int32(p), j)
        np.testing.assert_allclose(logits[j], want_logits[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(conf[j], want_conf[0], rtol=1e-5, atol=1e-5)


def test_anchors_stay_inside_their_document():
    seg = jnp.asarray([[1] * 9 + [2] * 12 + [0] * 3], jnp.int32)
    p, valid = pick_anchors(jax.random.key(0), seg, 20, 5)
    p, valid = np.asarray(p[0]), np.asarray(valid[0])
    s = np.asarray(seg[0])
    allowed = {q for q in range(len(s)) if s[q] > 0 and q + 6 < len(s) and (s[q: q + 7] == s[q]).all()}
    assert set(p[valid]) == allowed and len(allowed) == 9  # 3 anchors in document 1, 6 in document 2
    assert len(set(p[valid])) == valid.sum()


def test_shipped_config_and_bad_keys(tmp_path):
    cfg = load_config(REPO / "configs" / "dspark_tiny.yaml")
    assert cfg.target == "runs/pretrain_tiny" and cfg.anchors == 16
    assert load_config(REPO / "configs" / "dspark_tiny.yaml", ["dspark_train.steps=70"]).steps == 70
    assert cfg.init_from == "" and load_config(REPO / "configs" / "dspark_tiny.yaml",
                                               ["dspark_train.init_from=d.npz"]).init_from == "d.npz"
    bad = tmp_path / "bad.yaml"
    bad.write_text("dspark_train:\n  target: r\n  out: o\n  anchor: 3\n")
    with pytest.raises(ConfigError, match="unknown dspark_train keys"):
        load_config(bad)
    bad.write_text("dspark_train:\n  target: r\n  out: o\n  steps: 5\n  warmup_steps: 5\n")
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(bad)


def test_dsv41_train_runs_a_dspark_config(monkeypatch):
    """`dsv41 train --config` of a config with a dspark_train section trains a drafter, not the backbone."""
    import dsv41_jax.train.dspark
    import dsv41_jax.train.loop
    from dsv41_jax import cli

    calls = []
    monkeypatch.setattr(dsv41_jax.train.dspark, "train_dspark", lambda *a, **k: calls.append(("dspark", a)))
    monkeypatch.setattr(dsv41_jax.train.loop, "launch", lambda *a, **k: calls.append(("launch", a)))
    config = REPO / "configs" / "dspark_tiny.yaml"
    assert cli.main(["train", "--config", str(config), "dspark_train.steps=5"]) == 0
    assert calls == [("dspark", (config, ["dspark_train.steps=5"]))]
