"""Per-layer roles derived from the config lists (spec attention §1.2): data, not code.

Modules read their :class:`LayerSpec`; no layer number is written in model code, so the release and the
tiny config differ only in numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsv41_jax.config import ModelConfig

Role = Literal["swa", "full", "reindex", "reuse"]


@dataclass(frozen=True)
class LayerSpec:
    layer: int
    part: Literal["encoder", "decoder", "draft"]  # CED part (spec attention §9.1)
    ratio: int  # compress ratio m: 0 (pure SWA), 1 or 2
    role: Role
    kv_source: int | None  # layer whose main KV and index keys this layer reads
    topk_source: int | None  # layer whose top-k selection this layer uses
    candidate_source: bool  # publishes the hierarchical candidate pool
    uses_candidates: bool  # restricts its index scores to the pool (Reindex layers)
    engram: bool
    rope: Literal["plain", "yarn"]  # θ=rope_theta without YaRN, or compress_rope_theta with YaRN (spec §4)

    @property
    def owns_compressor(self) -> bool:
        return self.role == "full"

    @property
    def has_indexer(self) -> bool:  # index-query weights (wq_b, weights_proj)
        return self.role in ("full", "reindex")

    @property
    def compressed(self) -> bool:
        return self.ratio > 0


def _latest(ids: tuple[int, ...], layer: int) -> int | None:
    below = [s for s in ids if s <= layer]
    return below[-1] if below else None


def layer_spec(cfg: ModelConfig, layer: int) -> LayerSpec:
    """The spec of backbone layer ``layer`` (0 ≤ layer < n_layers) or DSpark stage ``layer - n_layers``."""
    a = cfg.attention
    m = a.compress_ratios[layer]
    if layer >= cfg.n_layers:
        return LayerSpec(layer, "draft", 0, "swa", None, None, False, False, False, "plain")
    part = "encoder" if layer < a.candidate_source_layer else "decoder"
    if m == 0:
        return LayerSpec(layer, part, 0, "swa", None, None, False, False, layer in cfg.engram.layer_ids, "plain")
    if layer in a.kv_source_layers:
        role: Role = "full"
    elif layer in a.index_source_layers:
        role = "reindex"
    else:
        role = "reuse"
    topk_source = _latest(a.index_source_layers, layer)
    return LayerSpec(
        layer=layer, part=part, ratio=m, role=role,
        kv_source=_latest(a.kv_source_layers, layer), topk_source=topk_source,
        candidate_source=layer == a.candidate_source_layer,
        uses_candidates=role == "reindex" and layer > a.candidate_source_layer,
        engram=layer in cfg.engram.layer_ids, rope="yarn")


def topology(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """Specs of the backbone layers 0..n_layers-1 (DSpark stages via :func:`layer_spec`)."""
    return tuple(layer_spec(cfg, i) for i in range(cfg.n_layers))


def describe(cfg: ModelConfig) -> str:
    """A human-readable table of the topology (one row per layer)."""
    rows = ["layer part     m role     kv  topk cand engram rope"]
    for s in topology(cfg):
        cand = "src" if s.candidate_source else ("use" if s.uses_candidates else "-")
        rows.append(f"{s.layer:5d} {s.part:8s} {s.ratio} {s.role:8s} {_fmt(s.kv_source):>3s} "
                    f"{_fmt(s.topk_source):>5s} {cand:4s} {'yes' if s.engram else '-':6s} {s.rope}")
    return "\n".join(rows)


def _fmt(x: int | None) -> str:
    return "-" if x is None else str(x)
