"""Preflight of a training run: the mesh, per-device memory and model FLOPs, from shapes alone.

Nothing is allocated: the model and the optimizer state are abstract (``jax.eval_shape``) and the mesh may be
an :class:`~jax.sharding.AbstractMesh` of any size, so the release configuration can be checked for a
64-device mesh on a laptop (``dsv41 train --config ... --preflight --devices 64``).

Per device:
- parameters, gradients and optimizer state are exact: each leaf's bytes divided by the number of devices
  its PartitionSpec (the sharding table, ``dsv41_jax.sharding``) splits it over;
- activations are an estimate: bytes per token, per layer, per residual-stream element, calibrated on the
  H200 (``configs/small.yaml``, 4,096 tokens, bf16, no remat: 109.6 GiB in all; BENCHMARKS.md), scaled by the
  activation dtype; ``remat: block`` keeps every block's input plus the working set of one block's recompute
  and backward, ``REMAT_LIVE_BLOCKS`` blocks' worth of activations (calibrated on ``configs/small.yaml`` at
  8,192 tokens, remat block: 37.1 GiB in all with the XLA attention on an H100, 32.1 with the Triton kernels on
  an H200; the larger is kept, so the check errs towards refusing).

``model_flops_per_token`` counts forward + backward FLOPs per token for MFU: 6 × the active matmul
parameters (routed experts at k/E), attention over the keys each query reads (window + top-k compressed
entries), and the indexer's scans (full over visible entries on Full layers, the candidate pool on Reindex).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dsv41_jax.config import ConfigError, ModelConfig

# bytes per (token × layer × hc_mult × dim) of saved activations at 2-byte activations, no remat
ACTIVATION_BYTES_PER_ELEMENT = 153.0
# under remat: one block's activations times this are live at once (its recompute, its backward's temporaries)
REMAT_LIVE_BLOCKS = 3.9
PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}  # dense bf16 per device


class Preflight(NamedTuple):
    mesh: dict[str, int]
    params_gb: float  # per device
    grads_gb: float
    optimizer_gb: float
    activations_gb: float  # estimate
    total_gb: float
    flops_per_token: float
    active_params: float
    tokens_per_device: int


def _per_device_bytes(tree, specs, mesh_shape: dict[str, int]) -> float:
    total = 0.0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                          strict=True):
        split = 1
        for entry in spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                split *= mesh_shape[axis]
        total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize / split
    return total


def model_flops_per_token(cfg: ModelConfig, seq: int) -> tuple[float, float]:
    """(forward + backward FLOPs per token, active matmul parameters) at sequence length ``seq``."""
    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.topology import layer_spec

    a, m = cfg.attention, cfg.moe
    matmul = 0.0
    for name, v in flat_variables(abstract_model(cfg)).items():
        if len(v.shape) < 2 or name.startswith("embed") or "engram.tables" in name or ".emb" in name:
            continue  # lookups, not matmuls
        matmul += math.prod(v.shape) * (m.n_activated_experts / m.n_routed_experts if ".experts." in name else 1.0)
    pos = np.arange(1, seq + 1)
    attn = index = 0.0
    for i in range(cfg.n_layers):
        spec = layer_spec(cfg, i)
        keys = np.minimum(pos, a.window_size).astype(np.float64)
        if spec.ratio:
            comps = pos // spec.ratio
            keys = keys + np.minimum(comps, a.index_topk)
            if i in a.index_source_layers:
                pool = a.candidate_topk_blocks * a.candidate_block_size
                scanned = np.minimum(comps, pool) if spec.role == "reindex" else comps
                index += 2 * a.index_n_heads * a.index_head_dim * scanned.mean()
        attn += 4 * a.n_heads * a.head_dim * keys.mean()
    return 6 * matmul + 3 * attn + 3 * index, matmul


def preflight(model_cfg: ModelConfig, ocfg, mesh_shape: dict[str, int], batch: int, seq: int,
              remat: str = "none", grad_accum: int = 1) -> Preflight:
    """Per-device memory and FLOPs of a run on a mesh of ``mesh_shape`` (no allocation)."""
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.optim import opt_state_partition_specs, optimizer
    from dsv41_jax.sharding import state_partition_specs
    from dsv41_jax.train.step import split_model

    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    model = abstract_model(model_cfg)
    _, params, biases, _ = split_model(model)
    tx = optimizer(model_cfg, ocfg)
    p_specs = state_partition_specs(params, mesh=mesh)
    opt = jax.eval_shape(tx.init, params)
    o_specs = opt_state_partition_specs(tx, params, p_specs)
    params_b = _per_device_bytes(params, p_specs, mesh_shape) + _per_device_bytes(
        biases, state_partition_specs(biases, mesh=mesh), mesh_shape)
    grads_b = _per_device_bytes(params, p_specs, mesh_shape) * (2 if grad_accum > 1 else 1)  # + accumulator
    opt_b = _per_device_bytes(opt, o_specs, mesh_shape)
    split = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["expert"]
    tokens = max(batch // split, 1) * seq
    width = np.dtype(model_cfg.dtype).itemsize / 2
    per_layer = tokens * model_cfg.mhc.hc_mult * model_cfg.dim * ACTIVATION_BYTES_PER_ELEMENT * width
    if remat == "none":
        act = per_layer * model_cfg.n_layers
    else:  # every block's input (fp32 streams) + one block's recompute and backward at a time
        act = tokens * model_cfg.mhc.hc_mult * model_cfg.dim * 4 * model_cfg.n_layers + REMAT_LIVE_BLOCKS * per_layer
    flops, active = model_flops_per_token(model_cfg, seq)
    gb = 2.0 ** 30
    return Preflight(dict(mesh_shape), params_b / gb, grads_b / gb, opt_b / gb, act / gb,
                     (params_b + grads_b + opt_b + act) / gb, flops, active, tokens)


def format_preflight(p: Preflight, limit_gb: float | None = None) -> str:
    lines = [f"preflight: mesh {p.mesh}, {p.tokens_per_device:,} tokens per device per micro-batch",
             f"  per device: parameters {p.params_gb:,.2f} GiB, gradients {p.grads_gb:,.2f} GiB, optimizer "
             f"{p.optimizer_gb:,.2f} GiB, activations ~{p.activations_gb:,.2f} GiB (estimate) = "
             f"{p.total_gb:,.2f} GiB" + (f" of {limit_gb:,.1f} GiB" if limit_gb else ""),
             f"  model FLOPs {p.flops_per_token / 1e9:,.2f} GFLOP/token (forward + backward), "
             f"{p.active_params / 1e9:,.3f} B active matmul parameters"]
    return "\n".join(lines)


def device_limit_gb() -> float | None:
    """Memory of one local device in GiB, where the backend reports it (GPUs, TPUs); None on CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit / 2.0 ** 30 if limit else None


def check_fits(p: Preflight, limit_gb: float | None, source: str | None = None) -> None:
    """Refuse a run whose estimate exceeds the device memory, naming the largest part and what helps."""
    if limit_gb is None or p.total_gb <= limit_gb:
        return
    parts = {"parameters": p.params_gb, "gradients": p.grads_gb, "optimizer state": p.optimizer_gb,
             "activations": p.activations_gb}
    worst = max(parts, key=parts.get)
    raise ConfigError(f"{source or 'run'}: needs about {p.total_gb:,.1f} GiB per device but a device has "
                      f"{limit_gb:,.1f} GiB ({worst} {parts[worst]:,.1f} GiB is the largest part): shard more "
                      f"(mesh.fsdp / mesh.expert), lower data.batch_size or data.seq_len, or set remat: block")


def peak_flops() -> float | None:
    """Dense bf16 peak of one local device, if known (for MFU)."""
    return PEAK_FLOPS.get(jax.local_devices()[0].device_kind)
