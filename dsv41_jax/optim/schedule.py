"""Learning-rate schedule of V4.1 pre-training (spec model §9.4): warm-up, constant, cosine decay, floor."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from dsv41_jax.optim.config import OptimConfig


def lr_at(step: Int[Array, ""] | int, cfg: OptimConfig) -> Float[Array, ""]:
    """The learning rate of update number ``step`` (0-based).

    Warm-up is linear and reaches the peak at its last step, ``lr·(step+1)/warmup_steps``, so the first
    update already moves the weights [INF: the report says only "linear warm-up over 2,000 steps"].
    Cosine from ``lr`` at ``constant_until`` to ``lr_floor`` at ``decay_until``; ``lr_floor`` after.
    """
    t = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * jnp.minimum(1.0, (t + 1) / max(cfg.warmup_steps, 1))
    span = max(cfg.decay_until - cfg.constant_until, 1)
    frac = jnp.clip((t - cfg.constant_until) / span, 0.0, 1.0)
    cosine = cfg.lr_floor + (cfg.lr - cfg.lr_floor) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return jnp.where(t < cfg.constant_until, warm, cosine)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """:func:`lr_at` as an optax schedule (a function of the update count)."""
    return lambda count: lr_at(count, cfg)
