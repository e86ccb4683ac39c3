"""The model's sparse-attention arguments as one key array and a key-row list per query.

:func:`dsv41_jax.model.sparse.sparse_attention` takes its keys from up to three places: this chunk's own
window entries, a window prefix from the store (an SWA ring, positions ``prefix_pos``), and the compressed
entries (``compressed_kv`` indexed by ``topk``, or already gathered as ``picked``). The kernels see two key
arrays, ``main`` (the compressed entries, or ``picked`` as [B, S·K, H]: no copy of a cache) and ``extra``
(the window entries, then the prefix: small), and per query the rows it may attend to (``idx`` [B, S, L],
rows of ``main`` then of ``extra``, −1 where there is none), in the order compressed entries, window rows,
prefix slots. The visibility rules are the
reference's (spec attention §3.6, §5): a window key at chunk row ``j`` is seen by row ``i`` when
``i − W < j ≤ i``, ``start + j ≥ replay_start`` and ``j ≥ key_floor[i]``; a prefix slot when its position is
≥ 0, within the window of the query's absolute position and ≥ ``replay_start``.

Only the ``min(W, S)`` window rows that can be visible are listed, so a decode step (S = 1) lists one window
row, not W. ``L`` is padded with −1 to a multiple of ``multiple`` (the kernels' key tile).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def key_rows(
    window_kv: Float[Array, "B S H"],
    window: int,
    compressed_kv: Float[Array, "B T H"] | None = None,
    topk: Int[Array, "B S K"] | None = None,
    replay_start: int | Int[Array, ""] | Int[Array, "B"] = 0,
    *,
    start: Int[Array, "B"] | None = None,
    prefix_kv: Float[Array, "B P H"] | None = None,
    prefix_pos: Int[Array, "B P"] | None = None,
    picked: Float[Array, "B S K H"] | None = None,
    key_floor: Int[Array, "B S"] | None = None,
    dtype=None,
    multiple: int = 64,
) -> tuple[Float[Array, "B R H"], Float[Array, "B E H"], Int[Array, "B S L"]]:
    """``(main, extra, idx)``: the keys (in ``dtype``) and each query's visible rows of ``main ++ extra``."""
    if key_floor is not None and prefix_kv is not None:  # as the reference: documents belong to training rows
        raise ValueError("key_rows: key_floor (document starts of a training row) cannot be combined with "
                         "prefix_kv (a cache prefix)")
    b, s, h = window_kv.shape
    dtype = dtype or window_kv.dtype
    start = jnp.zeros((b,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    floor = jnp.broadcast_to(jnp.asarray(replay_start, jnp.int32), (b,))  # absolute
    rows = jnp.arange(s, dtype=jnp.int32)
    parts, lists, offset = [], [], 0

    if topk is not None:
        if picked is not None:  # [B, S, K, H]: query i's k-th pick is row i·K + k
            k = topk.shape[-1]
            parts.append(picked.reshape(b, s * k, h))
            own = rows[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None]
            lists.append(jnp.where(topk >= 0, own[None], -1))
        else:
            parts.append(compressed_kv)
            lists.append(jnp.where(topk >= 0, topk, -1).astype(jnp.int32))
        offset = parts[-1].shape[1]

    w = min(window, s)
    j = rows[:, None] - (w - 1) + jnp.arange(w, dtype=jnp.int32)[None]  # [S, w] chunk rows i−w+1 … i
    ok = (j >= 0)[None] & (start[:, None, None] + j[None] >= floor[:, None, None])
    if key_floor is not None:
        ok = ok & (j[None] >= key_floor[..., None])
    parts.append(window_kv)
    lists.append(jnp.where(ok, offset + j[None], -1))
    offset += s

    if prefix_kv is not None:
        qpos = start[:, None] + rows[None]  # [B, S]
        kp = prefix_pos[:, None, :]  # [B, 1, P]
        ok = (kp >= 0) & (kp > qpos[..., None] - window) & (kp >= floor[:, None, None])
        parts.append(prefix_kv)
        lists.append(jnp.where(ok, offset + jnp.arange(prefix_kv.shape[1], dtype=jnp.int32), -1))

    idx = jnp.concatenate([jnp.broadcast_to(x, (b, s, x.shape[-1])) for x in lists], axis=-1)
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, -idx.shape[-1] % multiple)), constant_values=-1)
    parts = [p.astype(dtype) for p in parts]
    main = parts[0]
    extra = jnp.concatenate(parts[1:], axis=1) if len(parts) > 2 else parts[1] if len(parts) == 2 else main
    return main, extra, idx
