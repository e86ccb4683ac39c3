"""Optimizer group of every parameter, from its checkpoint name (spec model §9.1).

Names are the release checkpoint's (``layers.3.attn.wq_b.weight``), the same strings as our NNX paths
(``dsv41_jax.checkpoint.tree``). Every name must match exactly one rule: an unknown parameter is an
error, never a silent default group.
"""

from __future__ import annotations

import re
from typing import Any

import jax

# Muon groups (spec §9.2). One label per way of cutting a weight into independently orthogonalised
# matrices; the transform behind each label knows its cut.
MUON = "muon"  # one matrix [Y, X] (out, in); stacked routed experts [E, Y, X] one per expert
MUON_Q_HEADS = "muon_q_heads"  # attn.wq_b [N·H, q_lora] as N matrices [H, q_lora]
MUON_INDEX_HEADS = "muon_index_heads"  # indexer.wq_b [N_idx·H_idx, q_lora] as N_idx matrices
MUON_OUT_GROUPS = "muon_out_groups"  # attn.wo_a [O·R, N/O·H] as O matrices [R, N/O·H] (block-diagonal) [INF]
# Sinkhorn-balanced momentum (spec §9.3): embed/head at ×1, Engram tables at ×engram_lr_mult
SINKHORN = "sinkhorn"
SINKHORN_ENGRAM = "sinkhorn_engram"
# AdamW (spec §9.1): weight decay on norm(-like) weights, none on biases and scale factors
ADAMW = "adamw"
ADAMW_NO_DECAY = "adamw_no_decay"
# router selection biases: moved by the aux-loss-free rule (balance.py), never by the optimizer (§5.3)
NOT_OPTIMIZED = "not_optimized"

GROUPS = (MUON, MUON_Q_HEADS, MUON_INDEX_HEADS, MUON_OUT_GROUPS, SINKHORN, SINKHORN_ENGRAM, ADAMW, ADAMW_NO_DECAY,
          NOT_OPTIMIZED)
# the spec's group (§9.1 table) of each label, for reports
SPEC_GROUP = {MUON: "Muon", MUON_Q_HEADS: "head-wise Muon", MUON_INDEX_HEADS: "head-wise Muon",
              MUON_OUT_GROUPS: "Muon", SINKHORN: "Sinkhorn", SINKHORN_ENGRAM: "Sinkhorn", ADAMW: "AdamW",
              ADAMW_NO_DECAY: "AdamW", NOT_OPTIMIZED: "not an optimizer"}

_ANY = r"(?:^|\.)"  # a rule matches a name's tail, so DSpark copies (``mtp.0.attn.wq_b.weight``) match too
_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((label, re.compile(pattern)) for label, pattern in (
    (MUON_Q_HEADS, _ANY + r"attn\.wq_b\.weight$"),
    (MUON_INDEX_HEADS, _ANY + r"attn\.indexer\.wq_b\.weight$"),
    (MUON_OUT_GROUPS, _ANY + r"attn\.wo_a\.weight$"),
    (MUON, _ANY + r"attn\.(?:wq_a|wkv|wo_b)\.weight$"),
    (MUON, _ANY + r"attn\.compressor\.(?:wkv|wgate)\.weight$"),
    (MUON, _ANY + r"attn\.indexer\.(?:wk|weights_proj)\.weight$"),
    (MUON, _ANY + r"ffn\.gate\.weight$"),
    (MUON, _ANY + r"ffn\.(?:experts|shared_experts)\.w[123]\.weight$"),
    (MUON, _ANY + r"hc_[a-z]+_fn$"),
    (MUON, _ANY + r"engram\.wkv\.weight$"),
    (MUON, _ANY + r"main_proj\.weight$"),
    (SINKHORN, r"^(?:embed|head)\.weight$"),
    (SINKHORN_ENGRAM, _ANY + r"engram\.embed\.weight$"),
    (ADAMW, _ANY + r"(?:attn_norm|ffn_norm|q_norm|kv_norm|k_norm|norm|main_norm)\.weight$"),
    # DSpark heads, not in the §9.1 table [INF]: the Markov tables [V, r] as the embedding and head; the
    # confidence head, a single output row [1, D + r] (Muon would only normalise it), as norm-like AdamW
    (SINKHORN, _ANY + r"markov_head\.(?:embed|head)\.weight$"),
    (ADAMW, _ANY + r"confidence_head\.proj\.weight$"),
    # Engram q/k weights are the RMSNorm weights of its gate's query and key [S]: decayed like norms [INF]
    (ADAMW, _ANY + r"engram\.(?:q_weight|k_weight)$"),
    (ADAMW_NO_DECAY, _ANY + r"hc_[a-z]+_(?:base|scale)$"),
    (ADAMW_NO_DECAY, _ANY + r"attn\.attn_sink$"),  # a per-head logit offset: a bias, so no decay [INF]
    (NOT_OPTIMIZED, _ANY + r"ffn\.gate\.(?:bias|bias_vl)$"),
))


def label_of(name: str) -> str:
    """The optimizer group of the parameter called ``name`` (a dotted checkpoint name)."""
    hits = {label for label, pattern in _RULES if pattern.search(name)}
    if len(hits) != 1:
        what = "no optimizer group" if not hits else f"several optimizer groups {sorted(hits)}"
        raise ValueError(f"parameter {name!r} matches {what}; add or fix its rule in dsv41_jax/optim/labels.py "
                         "(spec model §9.1 lists the groups)")
    return hits.pop()


def path_name(path: tuple) -> str:
    """The dotted checkpoint name of a pytree path into an NNX state or a nested dict.

    Attribute keys (``Variable.value``) are not part of the name; dict and sequence keys are.
    """
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
    return ".".join(parts)


def param_labels(params: Any) -> Any:
    """A tree like ``params`` (an ``nnx.State`` or nested dict) with each leaf replaced by its group label."""
    return jax.tree_util.tree_map_with_path(lambda path, _: label_of(path_name(path)), params)
