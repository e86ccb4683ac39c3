"""Plain-numpy (float64) transcriptions of the update formulas of spec model §9, written literally.

No shortcuts the library takes (closed-form Sinkhorn scaling vectors, transposed Newton–Schulz,
optax chaining) appear here, so agreement checks those shortcuts too.
"""

from __future__ import annotations

import numpy as np

NS_SCHEDULE = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2


def newton_schulz(d: np.ndarray, schedule=NS_SCHEDULE) -> np.ndarray:
    """Spec §9.2: X₀ = D/‖D‖_F; X ← aX + b(XXᵀ)X + c(XXᵀ)²X."""
    x = d / np.linalg.norm(d)
    for a, b, c in schedule:
        xxt = x @ x.T
        x = a * x + b * xxt @ x + c * xxt @ xxt @ x
    return x


def ns_scalar(sigma: np.ndarray, schedule=NS_SCHEDULE) -> np.ndarray:
    """The polynomial NS applies to each singular value of X₀."""
    for a, b, c in schedule:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def muon_step(w, g, m, *, lr, blocks=1, mu=0.95, rms=0.18, wd=0.1):
    """One spec §9.2 step for a weight [*E, rows, cols] whose rows are cut into ``blocks`` matrices."""
    m = mu * m + g
    d = mu * m + g
    o = np.zeros_like(d)
    for idx in np.ndindex(*d.shape[:-2]):
        rows = d.shape[-2] // blocks
        for b in range(blocks):
            block = d[idx][b * rows:(b + 1) * rows]
            o[idx][b * rows:(b + 1) * rows] = newton_schulz(block) * np.sqrt(max(block.shape)) * rms
    return w * (1 - lr * wd) - lr * o, m


def sinkhorn_step(w, g, m, *, lr, lr_mult=1.0, beta=0.95, tau=1e-3, iters=11, eps=1e-20, gamma=0.18):
    """One spec §9.3 (Algorithm 1) step for a table [rows, features], loop as written."""
    m = beta * m + (1 - beta) * g
    n = beta * m + (1 - beta) * g
    rho = np.linalg.norm(n, axis=1)
    u = np.where((rho <= tau * rho.mean())[:, None], 0.0, n)
    for step in range(1, iters + 1):
        if step % 2:
            u = u / (np.linalg.norm(u, axis=1, keepdims=True) + eps)
        else:
            u = u / (np.linalg.norm(u, axis=0, keepdims=True) + eps)
    delta = np.sqrt(n.shape[1]) * u
    return w - gamma * lr * lr_mult * delta, m


def adamw_step(w, g, m, v, t, *, lr, wd, b1=0.9, b2=0.95, eps=1e-20):
    """AdamW with bias correction; ``t`` is the 1-based step."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return w - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * w), m, v
