"""Every parameter of the tiny and the release model is in exactly one group of spec model §9.1."""

from __future__ import annotations

import collections
import math
import re

import jax
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.tree import flat_variables
from dsv41_jax.model.moe import RouterBias
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.optim import labels as L

# every parameter family of the backbone (layer index as #) and its group, written out from spec §9.1
EXPECTED = {
    "embed.weight": L.SINKHORN, "head.weight": L.SINKHORN, "norm.weight": L.ADAMW,
    "layers.#.attn.wq_a.weight": L.MUON, "layers.#.attn.wq_b.weight": L.MUON_Q_HEADS,
    "layers.#.attn.wkv.weight": L.MUON, "layers.#.attn.wo_a.weight": L.MUON_OUT_GROUPS,
    "layers.#.attn.wo_b.weight": L.MUON, "layers.#.attn.q_norm.weight": L.ADAMW,
    "layers.#.attn.kv_norm.weight": L.ADAMW, "layers.#.attn.attn_sink": L.ADAMW_NO_DECAY,
    "layers.#.attn.compressor.wkv.weight": L.MUON, "layers.#.attn.compressor.wgate.weight": L.MUON,
    "layers.#.attn.compressor.norm.weight": L.ADAMW,
    "layers.#.attn.indexer.wq_b.weight": L.MUON_INDEX_HEADS, "layers.#.attn.indexer.wk.weight": L.MUON,
    "layers.#.attn.indexer.weights_proj.weight": L.MUON, "layers.#.attn.indexer.k_norm.weight": L.ADAMW,
    "layers.#.attn_norm.weight": L.ADAMW, "layers.#.ffn_norm.weight": L.ADAMW,
    "layers.#.ffn.gate.weight": L.MUON, "layers.#.ffn.gate.bias": L.NOT_OPTIMIZED,
    "layers.#.ffn.gate.bias_vl": L.NOT_OPTIMIZED,
    **{f"layers.#.ffn.{e}.w{i}.weight": L.MUON for e in ("experts", "shared_experts") for i in (1, 2, 3)},
    **{f"layers.#.hc_{s}_fn": L.MUON for s in ("attn", "ffn")},
    **{f"layers.#.hc_{s}_{v}": L.ADAMW_NO_DECAY for s in ("attn", "ffn") for v in ("base", "scale")},
    "layers.#.engram.embed.weight": L.SINKHORN_ENGRAM, "layers.#.engram.wkv.weight": L.MUON,
    "layers.#.engram.q_weight": L.ADAMW, "layers.#.engram.k_weight": L.ADAMW,
}


@pytest.fixture(scope="module")
def release_vars(release_model):
    return flat_variables(release_model)


@pytest.fixture(scope="module")
def tiny_vars():
    return flat_variables(abstract_model(C.tiny()))


@pytest.mark.parametrize("which", ["tiny", "release"])
def test_every_variable_has_exactly_one_group(which, tiny_vars, release_vars):
    variables = tiny_vars if which == "tiny" else release_vars
    families = {re.sub(r"^layers\.\d+\.", "layers.#.", n) for n in variables}
    assert families == set(EXPECTED)  # no family the table above has not decided
    for name, var in variables.items():
        label = L.label_of(name)  # raises if no rule or several rules match
        assert label == EXPECTED[re.sub(r"^layers\.\d+\.", "layers.#.", name)], name
        assert (label == L.NOT_OPTIMIZED) == isinstance(var, RouterBias), name


def test_release_group_counts(release_vars):
    cfg = C.v41_flash()
    counts, sizes = collections.Counter(), collections.Counter()
    for name, var in release_vars.items():
        counts[L.label_of(name)] += 1
        sizes[L.label_of(name)] += math.prod(var.get_value().shape)
    n = cfg.n_layers
    assert counts[L.MUON_Q_HEADS] == counts[L.MUON_OUT_GROUPS] == n
    assert counts[L.MUON_INDEX_HEADS] == len(cfg.attention.index_source_layers)
    assert counts[L.SINKHORN] == 2 and counts[L.SINKHORN_ENGRAM] == len(cfg.engram.layer_ids)
    assert counts[L.NOT_OPTIMIZED] == 2 * n
    assert sizes[L.SINKHORN_ENGRAM] == sum(cfg.engram.num_embeddings) * cfg.engram.head_dim  # 196.61 B
    assert sizes[L.MUON_Q_HEADS] == n * 64 * 512 * 1280  # 64 heads of [512, 1280] per layer
    assert sizes[L.MUON_INDEX_HEADS] == 8 * 32 * 128 * 1280  # 32 index heads of [128, 1280]
    assert sum(sizes.values()) == pytest.approx(551.88e9 + 196.61e9, abs=0.01e9)  # spec §2.1 backbone + tables


def test_param_labels_on_nnx_state_match_names(tiny_cfg):
    _, params, _ = nnx.split(abstract_model(tiny_cfg), nnx.Param, ...)
    labels = L.param_labels(params)
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(labels)}
    assert flat and all(v.get_value() == L.label_of(n) for n, v in flat.items())
    assert not any(v.get_value() == L.NOT_OPTIMIZED for v in flat.values())  # biases are not nnx.Param
    assert len(jax.tree.leaves(labels)) == len(jax.tree.leaves(params))


def test_unknown_parameter_is_an_error_that_names_it():
    with pytest.raises(ValueError, match=r"'vision\.blocks\.0\.attn\.wqkv\.weight'.*labels\.py"):
        L.label_of("vision.blocks.0.attn.wqkv.weight")


def test_dspark_copies_of_backbone_names_are_labelled():
    assert L.label_of("mtp.0.attn.wq_b.weight") == L.MUON_Q_HEADS
    assert L.label_of("mtp.0.main_proj.weight") == L.MUON
    assert L.label_of("mtp.1.ffn.experts.w1.weight") == L.MUON
