"""Rotary position embedding on the trailing lanes, interleaved pairs, with YaRN (spec attention §4)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dsv41_jax.config import AttentionConfig


def yarn_bounds(dim: int, theta: float, factor_base: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """Pair indices (low, high) between which YaRN blends the frequencies (spec attention §4)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(factor_base / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    return low, high


def rope_frequencies(cfg: AttentionConfig, kind: str) -> np.ndarray:
    """fp32 frequencies f_k, k < rope_head_dim/2: θ=rope_theta plain, or compress_rope_theta with YaRN."""
    dim = cfg.rope_head_dim
    theta = cfg.rope_theta if kind == "plain" else cfg.compress_rope_theta
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if kind == "plain":
        return freqs.astype(np.float32)
    low, high = yarn_bounds(dim, theta, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
    # YaRN frequency interpolation only: no attention-temperature factor (spec attention §4)
    return (freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)).astype(np.float32)


def apply_rope(
    x: Float[Array, "..."],
    positions: Int[Array, "..."],
    freqs: Float[Array | np.ndarray, "F"],
    *,
    heads: bool,
    inverse: bool = False,
) -> Float[Array, "..."]:
    """Rotate the trailing ``2·len(freqs)`` lanes of ``x`` [*B, S, N, H] (or [*B, S, H]) at ``positions``
    [*B, S] as interleaved (even, odd) pairs.

    ``heads`` says whether ``x`` has the head axis N after the sequence axis (the two forms are one shape
    pattern apart, so the annotation leaves the axes to this sentence). Angles and rotation are fp32 and
    the result is cast back to ``x.dtype``; ``inverse`` applies the conjugate rotation (output path, §3.7).
    """
    rd = 2 * freqs.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [*B, S, rd/2]
    if heads:
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    rot = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    a, b = rot[..., 0], rot[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([x[..., :-rd], out.astype(x.dtype)], axis=-1)
