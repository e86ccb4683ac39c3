"""Sparse attention with sink: one softmax over window keys + selected compressed entries (spec attention §3.6).

K = V = the ``H``-wide latent (MQA: all ``N`` query heads share it). The window part is computed in chunks
of ``W`` queries against their own and the previous chunk (no per-query copy of the window), the compressed
part gathers the top-k entries per query. No [S, T] mask is built; :func:`dense_attention` is the oracle
that does build it, for tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

NEG_INF = -jnp.inf


def _pad_seq(x: jax.Array, length: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _window_mask(n_chunks: int, window: int, replay_start: int) -> jax.Array:
    """[c, W, 2W] bool: key j of chunk c's band is visible to query i (positions absolute from 0)."""
    qpos = jnp.arange(n_chunks * window).reshape(n_chunks, window)
    kpos = (jnp.arange(n_chunks)[:, None] - 1) * window + jnp.arange(2 * window)[None]
    q, k = qpos[:, :, None], kpos[:, None, :]
    return (k <= q) & (k > q - window) & (k >= replay_start)


def sparse_attention(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array, "N"],
    window: int,
    compressed_kv: Float[Array, "B T H"] | None = None,
    topk: Int[Array, "B S K"] | None = None,
    replay_start: int = 0,
) -> Float[Array, "B S N H"]:
    """Attention of every query position to its window and to its selected compressed entries.

    Query ``i`` sees window keys ``max(replay_start, i−W+1) … i`` and the compressed entries listed in
    ``topk[i]`` (−1 = empty). The per-head sink logit enters only the denominator. Logits and the
    denominator are fp32; probabilities are cast to the activation dtype before P·V (spec §3.6).
    """
    b, s, n, h = q.shape
    dt = q.dtype
    scale = h ** -0.5
    nc = -(-s // window)
    qc = _pad_seq(q, nc * window).reshape(b, nc, window, n, h)
    kv = _pad_seq(window_kv, nc * window).reshape(b, nc, window, h)
    band = jnp.concatenate([jnp.pad(kv[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), kv], axis=2)  # [B,c,2W,H]
    lw = jnp.einsum("bcinh,bcjh->bcinj", qc, band, preferred_element_type=jnp.float32) * scale
    lw = jnp.where(_window_mask(nc, window, replay_start)[None, :, :, None, :], lw, NEG_INF)
    sink = sink.astype(jnp.float32)[:, None]  # [N, 1]
    mx = jnp.maximum(lw.max(-1, keepdims=True), sink)
    if compressed_kv is not None:
        idx = _pad_seq(topk, nc * window, value=-1)  # [B, S', K]
        picked = jax.vmap(lambda kv_, i: kv_[jnp.maximum(i, 0)])(compressed_kv, idx)  # [B, S', K, H]
        picked = picked.reshape(b, nc, window, -1, h)
        lc = jnp.einsum("bcinh,bcikh->bcink", qc, picked, preferred_element_type=jnp.float32) * scale
        lc = jnp.where(idx.reshape(b, nc, window, 1, -1) >= 0, lc, NEG_INF)
        mx = jnp.maximum(mx, lc.max(-1, keepdims=True))
    mx = jax.lax.stop_gradient(mx)
    pw = jnp.exp(lw - mx)
    den = pw.sum(-1) + jnp.exp(sink - mx)[..., 0]
    out = jnp.einsum("bcinj,bcjh->bcinh", pw.astype(dt), band, preferred_element_type=jnp.float32)
    if compressed_kv is not None:
        pc = jnp.exp(lc - mx)
        den = den + pc.sum(-1)
        out = out + jnp.einsum("bcink,bcikh->bcinh", pc.astype(dt), picked, preferred_element_type=jnp.float32)
    out = out / den[..., None]
    return out.reshape(b, nc * window, n, h)[:, :s].astype(dt)


def dense_attention(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array, "N"],
    window: int,
    compressed_kv: Float[Array, "B T H"] | None = None,
    topk: Int[Array, "B S K"] | None = None,
    replay_start: int = 0,
) -> Float[Array, "B S N H"]:
    """Test oracle: the same attention with a dense [S, S+T] mask, all in fp32."""
    s, h = q.shape[1], q.shape[-1]
    pos = jnp.arange(s)
    keys = window_kv.astype(jnp.float32)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window) & (pos[None, :] >= replay_start)
    mask = jnp.broadcast_to(mask, (q.shape[0], s, s))
    if compressed_kv is not None:
        t = compressed_kv.shape[1]
        chosen = (topk[..., None] == jnp.arange(t)).any(-2)  # [B, S, T]
        keys = jnp.concatenate([keys, compressed_kv.astype(jnp.float32)], axis=1)
        mask = jnp.concatenate([mask, chosen], axis=-1)
    logits = jnp.einsum("bsnh,bth->bsnt", q.astype(jnp.float32), keys, precision="highest") * h ** -0.5
    logits = jnp.where(mask[:, :, None, :], logits, NEG_INF)
    sink = jnp.broadcast_to(sink.astype(jnp.float32)[None, None, :, None], (*logits.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bsnt,bth->bsnh", probs, keys, precision="highest").astype(q.dtype)
