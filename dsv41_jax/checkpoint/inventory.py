"""The release checkpoint's tensor inventory, generated from a config (spec model §2.4 generator rules).

Every name, safetensors dtype and stored shape the release format has for a config: the 96,085 tensors
of DeepSeek-V4.1-Flash for the release config, 1,167 for the golden tiny checkpoint. The converter checks
a download against it before reading any data; the synthetic writer (``fake_hf``) writes exactly it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import NamedTuple

from dsv41_jax.checkpoint.safetensors import DTYPES
from dsv41_jax.config import ModelConfig

__all__ = ["TensorSpec", "dequantised", "expected_inventory", "inventory_bytes", "is_quantised",
           "structure_sha256"]

FP8_BLOCK = 32  # spec model §2.2: 32x32 weight blocks, per-row 32-column groups for FP4 and Engram


class TensorSpec(NamedTuple):
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self):
        self.out: list[TensorSpec] = []

    def add(self, name: str, dtype: str, *shape: int) -> None:
        self.out.append(TensorSpec(name, dtype, tuple(shape)))

    def fp8(self, name: str, d_out: int, d_in: int) -> None:
        # spec model §2.2: F8_E4M3 [out, in] + F8_E8M0 scale per 32x32 block
        self.add(f"{name}.weight", "F8_E4M3", d_out, d_in)
        self.add(f"{name}.scale", "F8_E8M0", _cdiv(d_out, FP8_BLOCK), _cdiv(d_in, FP8_BLOCK))

    def fp4(self, name: str, d_out: int, d_in: int) -> None:
        # spec model §2.2: two E2M1 codes per I8 byte, one E8M0 scale per row and 32 input columns
        self.add(f"{name}.weight", "I8", d_out, d_in // 2)
        self.add(f"{name}.scale", "F8_E8M0", d_out, _cdiv(d_in, FP8_BLOCK))


def _attention_core(b: _Builder, p: str, cfg: ModelConfig) -> None:
    a, d = cfg.attention, cfg.dim
    b.add(p + "attn.attn_sink", "F32", a.n_heads)
    b.add(p + "attn.q_norm.weight", "BF16", a.q_lora_rank)
    b.add(p + "attn.kv_norm.weight", "BF16", a.head_dim)
    b.fp8(p + "attn.wq_a", a.q_lora_rank, d)
    b.fp8(p + "attn.wq_b", a.n_heads * a.head_dim, a.q_lora_rank)
    b.fp8(p + "attn.wkv", a.head_dim, d)
    b.fp8(p + "attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads // a.o_groups * a.head_dim)
    b.fp8(p + "attn.wo_b", d, a.o_groups * a.o_lora_rank)


def _block_common(b: _Builder, p: str, cfg: ModelConfig, n_experts: int) -> None:
    """Attention core, norms, MoE and mHC: what every backbone layer and DSpark stage has."""
    d, inter, m = cfg.dim, cfg.moe.moe_inter_dim, cfg.mhc.hc_mult
    _attention_core(b, p, cfg)
    b.add(p + "attn_norm.weight", "BF16", d)
    b.add(p + "ffn_norm.weight", "BF16", d)
    b.add(p + "ffn.gate.weight", "BF16", n_experts, d)
    b.add(p + "ffn.gate.bias", "F32", n_experts)
    b.add(p + "ffn.gate.bias_vl", "F32", n_experts)
    for e in range(n_experts):
        b.fp4(f"{p}ffn.experts.{e}.w1", inter, d)
        b.fp4(f"{p}ffn.experts.{e}.w2", d, inter)
        b.fp4(f"{p}ffn.experts.{e}.w3", inter, d)
    b.fp8(p + "ffn.shared_experts.w1", inter, d)
    b.fp8(p + "ffn.shared_experts.w2", d, inter)
    b.fp8(p + "ffn.shared_experts.w3", inter, d)
    for site in ("attn", "ffn"):  # spec model §4.1: fn [(2+M)·M, M·D], base [(2+M)·M], scale [3]
        b.add(f"{p}hc_{site}_fn", "F32", (2 + m) * m, m * d)
        b.add(f"{p}hc_{site}_base", "F32", (2 + m) * m)
        b.add(f"{p}hc_{site}_scale", "F32", 3)


def _layer_extras(b: _Builder, layer: int, cfg: ModelConfig) -> None:
    a, d, e = cfg.attention, cfg.dim, cfg.engram
    p = f"layers.{layer}."
    if layer in a.kv_source_layers:
        b.add(p + "attn.compressor.wkv.weight", "BF16", a.head_dim, d)
        if a.compress_ratios[layer] > 1:
            b.add(p + "attn.compressor.wgate.weight", "BF16", a.head_dim, d)
        b.add(p + "attn.compressor.norm.weight", "BF16", a.head_dim)
        b.add(p + "attn.indexer.wk.weight", "BF16", a.index_head_dim, a.head_dim)
        b.add(p + "attn.indexer.k_norm.weight", "BF16", a.index_head_dim)
    if layer in a.index_source_layers:
        b.add(p + "attn.indexer.weights_proj.weight", "BF16", a.index_n_heads, d)
        b.fp8(p + "attn.indexer.wq_b", a.index_n_heads * a.index_head_dim, a.q_lora_rank)
    if layer in e.layer_ids:
        rows = e.num_embeddings[e.layer_ids.index(layer)]
        # spec model §2.2: FP8 rows with a per-row scale per 32 columns (not 32x32 blocks)
        b.add(p + "engram.embed.weight", "F8_E4M3", rows, e.head_dim)
        b.add(p + "engram.embed.scale", "F8_E8M0", rows, _cdiv(e.head_dim, FP8_BLOCK))
        b.add(p + "engram.q_weight", "BF16", cfg.mhc.hc_mult, d)
        b.add(p + "engram.k_weight", "BF16", cfg.mhc.hc_mult, d)
        b.fp8(p + "engram.wkv", (cfg.mhc.hc_mult + 1) * d, e.n_columns * e.head_dim)


def _dspark(b: _Builder, cfg: ModelConfig) -> None:
    ds, d = cfg.dspark, cfg.dim
    for s in range(ds.n_layers):
        p = f"mtp.{s}."
        _block_common(b, p, cfg, ds.n_routed_experts)
        if s == 0:  # the first stage projects the concatenated target-layer features
            b.fp8(p + "main_proj", d, len(ds.target_layer_ids) * d)
            b.add(p + "main_norm.weight", "BF16", d)
        if s == ds.n_layers - 1:  # the last stage owns the output heads
            b.add(p + "norm.weight", "BF16", d)
            b.add(p + "markov_head.embed.weight", "BF16", cfg.vocab_size, ds.markov_rank)
            b.add(p + "markov_head.head.weight", "BF16", cfg.vocab_size, ds.markov_rank)
            b.add(p + "confidence_head.proj.weight", "BF16", 1, d + ds.markov_rank)


def _vision(b: _Builder, cfg: ModelConfig) -> None:
    v, d = cfg.vision, cfg.dim
    b.add("vision.patch_embed.proj.weight", "BF16", v.dim, 3 * v.patch_size**2)
    b.add("vision.patch_embed.proj.bias", "BF16", v.dim)
    for i in range(v.n_layers):
        p = f"vision.blocks.{i}."
        b.add(p + "attn.wqkv.weight", "BF16", 3 * v.dim, v.dim)
        b.add(p + "attn.wqkv.bias", "BF16", 3 * v.dim)
        b.add(p + "attn.wo.weight", "BF16", v.dim, v.dim)
        b.add(p + "attn.wo.bias", "BF16", v.dim)
        b.add(p + "mlp.w1.weight", "BF16", 2 * v.inter_dim, v.dim)  # gate and up fused
        b.add(p + "mlp.w2.weight", "BF16", v.dim, v.inter_dim)
        b.add(p + "norm1.weight", "BF16", v.dim)
        b.add(p + "norm2.weight", "BF16", v.dim)
    b.add("vision.norm.weight", "BF16", v.dim)
    # spec model §7.2: 3x3 pixel-unshuffle, then a 2-layer MLP into the model width
    b.add("aligner.w1.weight", "BF16", d, v.dim * v.downsample_ratio**2)
    b.add("aligner.w1.bias", "BF16", d)
    b.add("aligner.w2.weight", "BF16", d, d)
    b.add("aligner.w2.bias", "BF16", d)
    for name in ("image_start", "image_end", "image_newline"):
        b.add(name, "BF16", d)


def expected_inventory(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the release-format checkpoint of ``cfg``, in a natural (layer-major) order."""
    b = _Builder()
    b.add("embed.weight", "BF16", cfg.vocab_size, cfg.dim)
    for layer in range(cfg.n_layers):
        _block_common(b, f"layers.{layer}.", cfg, cfg.moe.n_routed_experts)
        _layer_extras(b, layer, cfg)
    b.add("norm.weight", "BF16", cfg.dim)
    b.add("head.weight", "BF16", cfg.vocab_size, cfg.dim)
    _dspark(b, cfg)
    _vision(b, cfg)
    return b.out


def dequantised(inventory: list[TensorSpec]) -> list[TensorSpec]:
    """The inventory of a bf16 export: Hugging Face's dequantised form of an FP8 checkpoint (the form of
    DeepSeek's ``fp8_cast_bf16.py``), every quantised ``X.weight`` one BF16 tensor of its logical shape
    (packed FP4 experts [out, in/2] -> [out, in]), no ``X.scale``, everything else as stored (spec model §2.2)."""
    out = []
    for t in inventory:
        if t.dtype == "F8_E8M0":
            continue  # scales exist only beside quantised weights
        if t.dtype == "F8_E4M3":
            t = TensorSpec(t.name, "BF16", t.shape)
        elif t.dtype == "I8":
            t = TensorSpec(t.name, "BF16", (*t.shape[:-1], 2 * t.shape[-1]))
        out.append(t)
    return out


def is_quantised(hf_config: dict) -> bool:
    """Whether an HF ``config.json`` describes the release's FP8 / FP4 storage: its ``quantization_config``
    says so (spec model §1.1); a bf16 export has none, as Hugging Face's dequantised checkpoints do not."""
    return "quantization_config" in hf_config


def inventory_bytes(inventory: list[TensorSpec]) -> int:
    return sum(t.nbytes for t in inventory)


def structure_sha256(inventory: list[TensorSpec]) -> str:
    """SHA-256 of the canonical JSON of the name-sorted records (spec model §2.7)."""
    records = [{"dtype": t.dtype, "name": t.name, "shape": list(t.shape), "size_bytes": t.nbytes}
               for t in sorted(inventory, key=lambda t: t.name)]
    text = json.dumps(records, separators=(",", ":"), sort_keys=True) + "\n"
    return hashlib.sha256(text.encode()).hexdigest()
