"""Sparse attention with sink: one softmax over window keys + selected compressed entries (spec attention §3.6).

K = V = the ``H``-wide latent (MQA: all ``N`` query heads share it). The window part is computed in chunks
of ``W`` queries against their own and the previous chunk (no per-query copy of the window), the compressed
part gathers the top-k entries per query. No [S, T] mask is built; :func:`dense_attention` is the oracle
that does build it, for tests only.

:func:`sparse_attention` is the core that :class:`~dsv41_jax.model.attention.Attention` calls, once, for every
store and role: the XLA reference that a kernel behind ``attention.kernel_backend`` replaces. Letters as in
``docs/dims.md``; ``Q`` counts the blocks of ``W`` queries, ``T`` a block's band of keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax.model.layers import mixed_einsum

NEG_INF = -jnp.inf


def _pad_seq(x: jax.Array, length: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _band_keys(n_chunks: int, block: int) -> jax.Array:
    """[Q, T] chunk-local position of each key of block q's band: the previous block (if any) + its own."""
    if n_chunks == 1:
        return jnp.arange(block)[None]
    return (jnp.arange(n_chunks)[:, None] - 1) * block + jnp.arange(2 * block)[None]


def _band_mask(n_chunks: int, block: int, window: int) -> jax.Array:
    """[Q, blk, T] bool: key t of block q's band is in query s's window (chunk-local positions)."""
    q = jnp.arange(n_chunks * block).reshape(n_chunks, block)[:, :, None]
    k = _band_keys(n_chunks, block)[:, None, :]
    return (k <= q) & (k > q - window) & (k >= 0)


def sparse_attention(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array | np.ndarray, "N"],
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
    return_mass: bool = False,
    causal: bool = True,
) -> Float[Array, "B S N H"] | tuple[Float[Array, "B S N H"], Float[Array, "B S K"]]:
    """Attention of a chunk of consecutive query positions to its window and its selected compressed entries.

    Row ``i`` is at absolute position ``p = start + i`` (``start`` defaults to 0). It sees window keys at
    positions ``max(replay_start, p−W+1) … p``: those of this chunk, and ``prefix_kv`` (e.g. an SWA ring)
    at ``prefix_pos`` (−1 = empty slot). It also sees the compressed entries ``topk[i]`` (−1 = empty),
    read from ``compressed_kv`` or given already gathered as ``picked``. The per-head sink logit enters
    only the denominator. Logits and the denominator are fp32; probabilities are cast to the activation
    dtype before P·V (spec §3.6). No [S, T] mask is built: the chunk is processed in blocks of W queries
    against their own and the previous block (one block of S queries when S ≤ W).

    ``key_floor`` (training on packed documents) is each query's lowest visible row of this chunk: the
    first token of its document, so the window never reaches into the previous document. With
    ``return_mass`` the result is ``(out, mass)``, ``mass[i, k] = Σ_h P_h(topk[i, k])`` the probability each
    selected entry got, summed over heads, without gradient (the indexer's sparse-stage target).

    ``causal=False`` is a DSpark draft block (spec model §8.3): every row sees every row of the chunk, and
    the ``prefix_kv`` keys the position before the chunk (``start − 1``) sees; the chunk is one block.
    """
    if key_floor is not None and prefix_kv is not None:
        raise ValueError("sparse_attention: key_floor (document starts of a training row) cannot be combined "
                         "with prefix_kv (a cache prefix)")
    b, s, n, h = q.shape
    dt = q.dtype
    qc, parts, nc, blk = _window_parts(q, window_kv, window, replay_start, start, key_floor, causal)
    if prefix_kv is not None:
        start = jnp.zeros((b,), jnp.int32) if start is None else start
        floor = jnp.broadcast_to(jnp.asarray(replay_start, jnp.int32), (b,))  # absolute replay start
        rows = jnp.arange(nc * blk)[None] if causal else jnp.full((1, nc * blk), -1)  # a block: as start − 1
        qpos = start[:, None] + rows  # [B, S']
        kp = prefix_pos[:, None, :]
        mask = (kp >= 0) & (kp > qpos[..., None] - window) & (kp >= floor[:, None, None])
        mask = mask.reshape(b, nc, blk, 1, -1)
        parts.append((_logits("bqsnh,bph->bqsnp", qc, prefix_kv, h ** -0.5, mask),
                      lambda p: mixed_einsum("bqsnp,bph->bqsnh", p, prefix_kv)))
    if topk is not None:
        if picked is None:
            picked = gather_entries(compressed_kv, jnp.maximum(topk, 0))  # [B, S, K, H]
        pc = _pad_seq(picked, nc * blk).reshape(b, nc, blk, -1, h)
        mask = (_pad_seq(topk, nc * blk, value=-1) >= 0).reshape(b, nc, blk, 1, -1)
        parts.append((_logits("bqsnh,bqskh->bqsnk", qc, pc, h ** -0.5, mask),
                      lambda p: mixed_einsum("bqsnk,bqskh->bqsnh", p, pc)))
    out, mx, den = _softmax_with_sink(parts, sink, dt)
    out = out.reshape(b, nc * blk, n, h)[:, :s].astype(dt)
    if not return_mass:
        return out
    if topk is None:
        raise ValueError("sparse_attention: return_mass needs compressed entries (topk)")
    return out, _head_mass(parts[-1][0], mx, den, s)


@jax.custom_vjp
def gather_entries(kv: Float[Array, "B T H"], idx: Int[Array, "B S K"]) -> Float[Array, "B S K H"]:
    """``kv[b, idx[b, s, k]]``; the gradient sums its S·K rows back into T entries in fp32.

    Each entry is picked by up to S queries, so the transpose of the gather is a scatter-add with heavy
    collisions. Left to autodiff it accumulates in the cache dtype: in bf16 that rounds at every one of
    thousands of additions, and on the H200 the bf16 scatter-add was half of a training step
    (BENCHMARKS.md, the train-step split). fp32 accumulation is the exact sum's rounding, done once.
    """
    return jax.vmap(lambda kv_, i: kv_[i])(kv, idx)


def _gather_fwd(kv, idx):
    return gather_entries(kv, idx), (idx, kv)  # kv only for its shape and dtype (live anyway: no copy)


def _gather_bwd(res, g):
    idx, kv = res
    acc = jax.vmap(lambda i, g_: jnp.zeros(kv.shape[1:], jnp.float32).at[i].add(g_.astype(jnp.float32)))(idx, g)
    return acc.astype(kv.dtype), None


gather_entries.defvjp(_gather_fwd, _gather_bwd)


def entry_mass(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array | np.ndarray, "N"],
    window: int,
    compressed_kv: Float[Array, "B T H"],
    visible: Bool[Array, "B S T"],
    *,
    key_floor: Int[Array, "B S"] | None = None,
) -> Float[Array, "B S T"]:
    """``Σ_h P_h(t)``: the probability the main attention would give each compressed entry ``t`` if the query
    attended to every entry of ``visible`` besides its window and the sink, in one softmax (spec §3.6).

    The dense-stage target of the indexer loss and the reference of the top-k agreement metric. fp32, no
    gradient. It costs one extra ``q·K`` over every visible entry ([B, S, N, T] logits), forward only.
    """
    q, window_kv, sink, compressed_kv = jax.lax.stop_gradient((q, window_kv, sink, compressed_kv))
    b, s, n, h = q.shape
    qc, parts, nc, blk = _window_parts(q, window_kv, window, 0, None, key_floor)
    mask = _pad_seq(visible, nc * blk, value=False).reshape(b, nc, blk, 1, -1)
    parts.append((_logits("bqsnh,bth->bqsnt", qc, compressed_kv, h ** -0.5, mask), None))
    mx, den = _max_and_denominator(parts, sink)
    return _head_mass(parts[-1][0], mx, den, s)


def _window_parts(q, window_kv, window: int, replay_start, start, key_floor, causal: bool = True):
    """Queries in blocks of W against their own and the previous block: ``(qc, [(logits, pv)], nc, blk)``;
    not ``causal``: one block whose rows all see each other."""
    b, s, n, h = q.shape
    start = jnp.zeros((b,), jnp.int32) if start is None else start
    floor = jnp.broadcast_to(jnp.asarray(replay_start, jnp.int32), (b,)) - start  # chunk-local replay start
    # blocks of W queries see their own and the previous block; a chunk no longer than W (e.g. a decode
    # step) is one block of its own length, so nothing is padded to W
    blk = window if s > window and causal else s
    nc = -(-s // blk)
    qc = _pad_seq(q, nc * blk).reshape(b, nc, blk, n, h)
    kv = _pad_seq(window_kv, nc * blk).reshape(b, nc, blk, h)
    band = kv if nc == 1 else jnp.concatenate([jnp.pad(kv[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), kv], axis=2)
    kloc = _band_keys(nc, blk)  # [Q, T] chunk-local
    within = _band_mask(nc, blk, window) if causal else jnp.ones((1, blk, blk), bool)
    band_mask = within[None] & (kloc[None, :, None, :] >= floor[:, None, None, None])
    if key_floor is not None:  # [B, Q, blk, T]: keys before the query's document start are invisible
        band_mask = band_mask & (kloc[None, :, None, :] >= _pad_seq(key_floor, nc * blk).reshape(b, nc, blk, 1))
    parts = [(_logits("bqsnh,bqth->bqsnt", qc, band, h ** -0.5, band_mask[:, :, :, None, :]),
              lambda p: mixed_einsum("bqsnt,bqth->bqsnh", p, band))]
    return qc, parts, nc, blk


def _head_mass(logits, mx, den, s: int):
    """Σ over heads of ``exp(logits − mx) / den`` for one part, [B, S, K], without gradient."""
    logits, mx, den = jax.lax.stop_gradient((logits, mx, den))
    mass = (jnp.exp(logits - mx) / den[..., None]).sum(-2)  # [B, Q, blk, K]
    b, nc, blk, k = mass.shape
    return mass.reshape(b, nc * blk, k)[:, :s]


def _logits(spec: str, q: jax.Array, k: jax.Array, scale: float, mask: jax.Array) -> jax.Array:
    logits = mixed_einsum(spec, q, k.astype(q.dtype)) * scale
    return jnp.where(mask, logits, NEG_INF)


def _max_and_denominator(parts, sink: jax.Array):
    """The running max (sink included, no gradient) and the softmax denominator over every part's keys."""
    sink = sink.astype(jnp.float32)[:, None]  # [N, 1]
    mx = sink
    for logits, _ in parts:
        mx = jnp.maximum(mx, logits.max(-1, keepdims=True))
    mx = jax.lax.stop_gradient(mx)
    den = jnp.exp(sink - mx)[..., 0]
    for logits, _ in parts:
        den = den + jnp.exp(logits - mx).sum(-1)
    return mx, den


def _softmax_with_sink(parts, sink: jax.Array, dtype):
    """One softmax over every part's keys plus the sink logit, which joins only the denominator.

    Returns ``(out, mx, den)``: the attention output and the max and denominator it used. (Written out
    rather than through :func:`_max_and_denominator`: sharing ``p`` between numerator and denominator keeps
    the gradient's summation order, bit for bit.)
    """
    sink = sink.astype(jnp.float32)[:, None]  # [N, 1]
    mx = sink
    for logits, _ in parts:
        mx = jnp.maximum(mx, logits.max(-1, keepdims=True))
    mx = jax.lax.stop_gradient(mx)
    den = jnp.exp(sink - mx)[..., 0]
    out = 0.0
    for logits, pv in parts:
        p = jnp.exp(logits - mx)
        den = den + p.sum(-1)
        out = out + pv(p.astype(dtype))
    return out / den[..., None], mx, den


def dense_attention(
    q: Float[Array, "B S N H"],
    window_kv: Float[Array, "B S H"],
    sink: Float[Array | np.ndarray, "N"],
    window: int,
    compressed_kv: Float[Array, "B T H"] | None = None,
    topk: Int[Array, "B S K"] | None = None,
    replay_start: int | Int[Array, ""] | Int[Array, "B"] = 0,
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
