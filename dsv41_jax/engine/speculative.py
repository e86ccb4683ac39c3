"""Speculative decoding with the DSpark drafter (spec model §8.4): draft, verify in one chunk, roll back.

One step per sequence: the drafter drafts ``y_1..y_K`` after the pending token ``a`` (already sampled, not yet
in the cache); the target runs ``[a, y_1..y_k]`` as one chunk of the engine's forward and yields ``k + 1``
next-token distributions. ``k`` is fixed, or chosen each step by the confidence scheduler (:func:`schedule_verify`)
and rounded up to one of a few compiled chunk widths (:func:`verify_widths`), so a shorter verify runs a
narrower forward. Greedy requests accept the longest prefix of
drafts equal to the target's argmax; sampling requests run speculative rejection sampling (accept ``y`` with
probability ``min(1, p(y)/q(y))``, else resample from ``normalize(max(p − q, 0))``), so the output distribution is
the target's. ``a`` and the accepted drafts are committed; the target's token after them (the correction, or
the bonus after full acceptance) becomes the next pending token.

Rejected positions are rolled back exactly (:func:`rollback`): the packed main-KV and index-key entries and the
SWA ring slots they overwrote get their previous bytes back, each ratio-2 source's compressor carry becomes the
last kept row's (the chunk's per-row carries, ``ChunkOptions.row_carries``), the Engram history advances by the
kept tokens only. The drafter's rings then observe the target features of every kept position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.config import ModelConfig
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_device import DeviceEngram, advance_history, device_row_ids
from dsv41_jax.model.dspark import DraftCache, DSpark
from dsv41_jax.model.transformer import Transformer

# per sequence: verify steps, drafts verified, drafts accepted, verify-chunk rows computed (the compiled widths)
STATS = ("steps", "drafted", "accepted", "rows")


class SpecState(NamedTuple):
    cache: C.Cache
    draft: DraftCache
    token: Int[Array, "B"]  # the pending token: sampled, not yet fed (it is emitted when it is fed)
    history: Array  # Engram history [B, J-1]
    n_seen: Array  # [B]
    done: Bool[Array, "B"]
    keys: Array  # [B] per-sequence PRNG keys
    step: Array  # scalar
    emitted: Int[Array, "B"]
    stats: Int[Array, "B 3"]  # STATS


def rollback(cfg: ModelConfig, before: C.Cache, after: C.Cache, chunk: int, n_keep: Int[Array, "B"],
             row_carries: dict[int, tuple[Array, Array]]) -> C.Cache:
    """The cache ``after`` a chunk of ``chunk`` ≤ window rows was fed from ``before``, cut back to its first
    ``n_keep`` rows: exactly the cache of feeding only those rows (the rows after them leave no trace).
    ``row_carries``: each ratio-2 source's per-row compressor carry of the chunk (``ChunkOptions.row_carries``)."""
    a = cfg.attention
    w = a.window_size
    if chunk > w:
        raise ValueError(f"a speculative chunk of {chunk} rows exceeds the window ({w}): ring slots would collide")
    rows = jnp.arange(chunk)[None]
    pos = before.lengths[:, None] + rows  # [B, S]
    dropped = rows >= n_keep[:, None]

    def restore(new: Array, old: Array, index: Int[Array, "B S"], size: int) -> Array:
        prev = jax.vmap(lambda o, i: o[i])(old, jnp.clip(index, 0, size - 1))
        return C.write_rows(new, prev, jnp.where(dropped, index, size))

    rings = tuple(C.RingCache(*(restore(n, o, pos % w, w) for n, o in zip(ra, rb, strict=True)))
                  for ra, rb in zip(after.rings, before.rings, strict=True))
    sources = []
    for layer, sa, sb in zip(a.kv_source_layers, after.sources, before.sources, strict=True):
        t, m = sa.kv_codes.shape[1], a.compress_ratios[layer]
        packed = [restore(n, o, pos // m, t) for n, o in zip(sa[:4], sb[:4], strict=True)]
        carry_c, carry_z = sb.carry_c, sb.carry_z
        if m > 1:
            last = jnp.maximum(n_keep - 1, 0)[:, None, None]
            kept = (n_keep > 0)[:, None]
            c, z = row_carries[layer]
            carry_c = jnp.where(kept, jnp.take_along_axis(c, last, 1)[:, 0], sb.carry_c)
            carry_z = jnp.where(kept, jnp.take_along_axis(z, last, 1)[:, 0], sb.carry_z)
        sources.append(C.SourceCache(*packed, carry_c, carry_z))
    return C.Cache(before.lengths + n_keep, rings, tuple(sources))


def accept_greedy(target_logits: Float[Array, "B S V"], drafts: Int[Array, "B K"], n_verify: Int[Array, "B"]
                  ) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
    """``(accepted, next)``: the longest prefix of the first ``n_verify`` drafts equal to the target's argmax, and
    the target's argmax after it (the correction, or the bonus after full acceptance)."""
    pred = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # row j predicts the token after row j
    k = drafts.shape[1]
    match = (pred[:, :k] == drafts) & (jnp.arange(k)[None] < n_verify[:, None])
    accepted = jnp.cumprod(match, axis=-1).sum(-1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(pred, accepted[:, None], 1)[:, 0]


def accept_sampled(keys: Array, target_probs: Float[Array, "B S V"], draft_probs: Float[Array, "B K V"],
                   drafts: Int[Array, "B K"], n_verify: Int[Array, "B"]) -> tuple[Int[Array, "B"], Int[Array, "B"]]:
    """Speculative rejection sampling: ``(accepted, next)`` with ``next`` drawn from ``normalize(max(p − q, 0))``
    at the first rejection, or from ``p`` after the last verified draft."""
    b, k = drafts.shape
    p_y = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], -1)[..., 0]
    q_y = jnp.take_along_axis(draft_probs, drafts[..., None], -1)[..., 0]
    k_accept, k_next = jax.vmap(jax.random.split, out_axes=1)(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_accept)
    ok = (u * q_y < p_y) & (jnp.arange(k)[None] < n_verify[:, None])  # u < p/q without dividing by q
    accepted = jnp.cumprod(ok, axis=-1).sum(-1).astype(jnp.int32)
    p = jnp.take_along_axis(target_probs, accepted[:, None, None], 1)[:, 0]
    q = jnp.take_along_axis(jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))), accepted[:, None, None], 1)[:, 0]
    rejected = (accepted < n_verify)[:, None]
    residual = jnp.where(rejected, jnp.maximum(p - q, 0.0), p)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)  # p == q: nothing left over
    nxt = jax.vmap(jax.random.categorical)(k_next, jnp.log(residual))
    return accepted, nxt.astype(jnp.int32)


def schedule_verify(confidence: Float[Array, "B K"], live: Bool[Array, "B"], sps: Float[Array, "N"]
                    ) -> Int[Array, "B"]:
    """Confidence-scheduled verify lengths (spec model §8.4, the DSpark paper's scheduler).

    Slot i's conditional acceptance is ``c_i = σ(conf_i)``, its prefix survival ``s_i = Π_{j≤i} c_j``. Over the
    live requests' candidate draft tokens sorted by ``s`` (ties: lower slot first, so each request's choice is a
    prefix), the number ``X`` of drafts verified maximises ``(B + Σ_{j≤X} s_(j)) · SPS(B + X)``: the expected
    tokens per step times the target's steps per second at ``B + X`` verified tokens (``sps[n]``; past the
    table's end its last value). Returns each request's number of drafts to verify.
    """
    b, k = confidence.shape
    surv = jnp.cumprod(jax.nn.sigmoid(confidence.astype(jnp.float32)), axis=-1)
    flat = jnp.where(live[:, None], surv, -1.0).reshape(-1)  # done requests sort last and are never chosen
    order = jnp.argsort(-flat, stable=True)
    gain = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.maximum(flat[order], 0.0))])  # [B·K + 1]
    n_live = live.sum()
    tokens = n_live + jnp.arange(b * k + 1)
    rate = sps[jnp.minimum(tokens, sps.shape[0] - 1)]
    best = jnp.argmax((n_live + gain) * rate)  # the first maximum: fewer tokens on a tie
    rank = jnp.zeros((b * k,), jnp.int32).at[order].set(jnp.arange(b * k, dtype=jnp.int32))
    chosen = (rank < best).reshape(b, k) & live[:, None]
    return chosen.sum(-1).astype(jnp.int32)


def verify_widths(k: int, scheduled: bool, widths: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The compiled widths of the verify chunk (rows per request), ascending, the widest ``k + 1``: ``widths`` as
    given, or by default ``k + 1`` alone for fixed-k and the powers of two below it too when verify lengths are
    scheduled. A :class:`ValueError` names a width outside ``1 .. k + 1`` or a set without ``k + 1``."""
    if not widths:
        widths = tuple(2 ** i for i in range(k.bit_length()) if 2 ** i < k + 1) if scheduled else ()
        return (*widths, k + 1)
    out = tuple(sorted(set(widths)))
    if out[0] < 1 or out[-1] != k + 1:
        raise ValueError(f"verify widths {widths}: each must lie in 1..{k + 1} (k + 1 drafts' chunk) and {k + 1} "
                         "must be one of them")
    return out


def _padded(out: tuple, rows: int) -> tuple:
    """A verify forward's ``(logits, cache, features, carries)`` over ``w`` rows, its row axes padded to ``rows``
    (padding: invalid rows, never read)."""
    logits, cache, feats, carries = out
    pad = lambda x: jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    w = feats.pos.shape[1]
    pos = jnp.concatenate([feats.pos, feats.pos[:, :1] + jnp.arange(w, rows)[None]], axis=1)
    feats = feats._replace(main_hidden=pad(feats.main_hidden), pos=pos, valid=pad(feats.valid))
    return pad(logits), cache, feats, {layer: tuple(map(pad, c)) for layer, c in carries.items()}


def verify_chunk(model: Transformer, cache: C.Cache, tokens: Int[Array, "B S"], rows: Array, n_new: Int[Array, "B"],
                 widths: tuple[int, ...], bucket: Int[Array, ""]):
    """The verify forward of ``tokens`` [B, k+1] at the compiled width ``widths[bucket]``: one program holds a
    branch per width (``lax.switch``) and each step runs only its own, so a narrower verify costs a narrower
    forward without recompiling. Rows past the width are padded (``n_new`` never reaches them)."""
    options = ChunkOptions(all_logits=True, main_hidden=True, row_carries=True)
    s = tokens.shape[1]

    def branch(w: int):
        return lambda: _padded(forward_chunk(model, cache, tokens[:, :w], rows[:, :w], n_new, options=options), s)

    if len(widths) == 1:
        return branch(widths[0])()
    return jax.lax.switch(bucket, [branch(w) for w in widths])


def speculative_step(model: Transformer, drafter: DSpark, tables: DeviceEngram, s: SpecState, *, k: int,
                     temperature: float, filtered, stop: Array, max_new_tokens: int, max_seq_len: int,
                     sps: Float[Array, "N"] | None = None, widths: tuple[int, ...] = ()
                     ) -> tuple[SpecState, Int[Array, "B S"]]:
    """One draft-verify-commit step for every live sequence; returns the state and the emitted tokens [B, k+1]
    (−1 where nothing was emitted). ``filtered(logits [N, V]) -> logits`` applies the request's temperature,
    top-k and top-p (the target distribution p). Each request verifies ``k`` drafts, or with a steps-per-second
    table ``sps`` the number :func:`schedule_verify` chooses from the drafter's confidences.

    The verify chunk runs at the narrowest of the compiled ``widths`` (:func:`verify_widths`) that holds the
    longest chosen verify; every live request then verifies ``width − 1`` drafts, since the rows of a
    rectangular chunk are computed for every request anyway (more verified drafts never lower the accepted
    length, and the output distribution does not depend on how many are verified)."""
    b = s.token.shape[0]
    live = ~s.done
    widths = widths or (k + 1,)
    keys = jax.vmap(jax.random.fold_in, (0, None))(s.keys, s.step)
    k_draft, k_accept = jax.vmap(jax.random.split, out_axes=1)(keys)
    draft = drafter.propose(model, s.draft, s.token, temperature=temperature, keys=k_draft)
    drafts = draft.ids[:, 1: k + 1]
    n_verify = jnp.full((b,), k, jnp.int32)
    if sps is not None:
        n_verify = schedule_verify(draft.confidence[:, :k], live, sps)
    need = jnp.max(jnp.where(live, n_verify, 0)) + 1
    bucket = jnp.minimum(jnp.searchsorted(jnp.asarray(widths), need), len(widths) - 1)  # the first width ≥ need
    width = jnp.asarray(widths, jnp.int32)[bucket]
    n_verify = jnp.full((b,), width - 1, jnp.int32)
    cols = jnp.arange(k + 1)[None]
    tokens = jnp.where(cols <= n_verify[:, None], jnp.concatenate([s.token[:, None], drafts], axis=1), 0)
    n_new = jnp.where(live, n_verify + 1, 0)
    rows, _, _ = device_row_ids(tables, s.history, s.n_seen, tokens)
    logits, fed, feats, carries = verify_chunk(model, s.cache, tokens, rows, n_new, widths, bucket)
    if temperature == 0:
        accepted, nxt = accept_greedy(logits, drafts, n_verify)
    else:
        v = logits.shape[-1]
        p = jax.nn.softmax(filtered(logits.reshape(-1, v)).reshape(logits.shape), axis=-1)
        q = jax.nn.softmax(draft.logits[:, :k] / temperature, axis=-1)
        accepted, nxt = accept_sampled(k_accept, p, q, drafts, n_verify)
    # emitted: the pending token and the accepted drafts, up to the first stop token and within the limits
    committed = cols <= accepted[:, None]
    is_stop = jnp.isin(tokens, stop) & committed
    first_stop = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, axis=-1), k + 1)
    n_emit = jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1),
                         jnp.minimum(max_new_tokens - s.emitted, max_seq_len - s.cache.lengths))
    n_emit = jnp.where(live, n_emit, 0)
    emitted = s.emitted + n_emit
    done = s.done | is_stop.any(-1) | (emitted >= max_new_tokens) | (s.cache.lengths + n_emit >= max_seq_len)
    # rows past the width were never written: restoring their slots rewrites the bytes already there
    cache = rollback(model.cfg, s.cache, fed, k + 1, n_emit, carries)
    kept = cols < n_emit[:, None]
    dcache = drafter.observe(s.draft, feats.main_hidden, feats.pos, feats.valid & kept)
    history, n_seen = advance_history(tables, s.history, s.n_seen, tokens, n_emit)
    stats = s.stats + jnp.stack([live, n_verify * live, accepted * live, width * live], axis=1).astype(jnp.int32)
    out = jnp.where(kept, tokens, -1)
    return SpecState(cache, dcache, nxt, history, n_seen, done, s.keys, s.step + 1, emitted, stats), out


def sps_by_tokens(batch: int, widths: Sequence[int], rates: Sequence[float]) -> list[float]:
    """The steps-per-second table :func:`schedule_verify` reads, ``sps[n]`` for ``n`` = 0 .. ``batch`` ·
    ``widths[-1]`` verified tokens in the batch: the rate of the narrowest compiled width that holds ⌈n / batch⌉
    rows per request, the chunk the engine would run (``rates[i]`` is the rate at ``widths[i]``, ascending)."""
    out = []
    for n in range(batch * widths[-1] + 1):
        rows = max(1, -(-n // batch))
        out.append(float(rates[next(i for i, w in enumerate(widths) if w >= rows)]))
    return out


def profile_sps(model: Transformer, tables: DeviceEngram, batch: int, max_drafts: int, *, widths: Sequence[int] = (),
                context: int = 256, repeats: int = 5, seed: int = 0) -> dict:
    """The target's verify steps per second at ``batch`` requests for each compiled verify width (rows per
    request; :func:`verify_widths` of ``max_drafts`` with scheduling, or ``widths`` as given), after a
    ``context``-token prefill (random ids): what :func:`schedule_verify`'s table is made of. Returns ``{"batch",
    "context", "widths", "steps_per_s", "sps"}`` with ``sps[n]`` (:func:`sps_by_tokens`) the steps per second at
    ``n`` verified tokens in the batch. Sampling with the table compiles the same widths."""
    import time

    import numpy as np
    from flax import nnx

    from dsv41_jax.engram_device import device_history_init

    widths = verify_widths(max_drafts, True, tuple(widths))
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    ratio = max((cfg.attention.compress_ratios[layer] for layer in cfg.attention.kv_source_layers), default=1)
    cache = C.init_cache(cfg, batch, -(-(context + max_drafts + 1) // ratio) * ratio)
    history, n_seen = device_history_init(tables, batch)
    options = ChunkOptions(all_logits=True, main_hidden=True, row_carries=True)

    @jax.jit
    def verify(state, cache, history, n_seen, tokens):
        rows, _, _ = device_row_ids(tables, history, n_seen, tokens)
        n_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        return forward_chunk(nnx.merge(graphdef, state), cache, tokens, rows, n_new, options=options)

    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(4, cfg.vocab_size, (batch, context)), jnp.int32)
    _, cache, *_ = verify(state, cache, history, n_seen, ids)
    history, n_seen = advance_history(tables, history, n_seen, ids, jnp.full((batch,), context, jnp.int32))
    rates = []
    for w in widths:
        tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (batch, w)), jnp.int32)
        jax.block_until_ready(verify(state, cache, history, n_seen, tokens))  # compile
        times = []
        for _ in range(repeats):
            tick = time.perf_counter()
            jax.block_until_ready(verify(state, cache, history, n_seen, tokens))
            times.append(time.perf_counter() - tick)
        rates.append(1.0 / float(np.median(times)))
    return {"batch": batch, "context": context, "widths": list(widths), "steps_per_s": rates,
            "sps": sps_by_tokens(batch, widths, rates)}
