"""Running a transform for a few steps in tests: one jitted update-and-apply (no per-op compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def run_steps(tx: optax.GradientTransformation, params: dict, grads: list[dict]) -> tuple[dict, optax.OptState]:
    """Apply ``tx`` with each gradient in turn (fp32); returns the final parameters (numpy) and state."""

    @jax.jit
    def step(params, state, grad):
        updates, state = tx.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state = tx.init(params)
    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v, jnp.float32) for k, v in g.items()})
    return {k: np.asarray(v) for k, v in params.items()}, state
