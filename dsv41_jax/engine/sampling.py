"""Generation: chunked prefill, then a jit-compiled decode loop (no Python per token) with sampling.

Engram row ids are hashed on the device (``engram_device``) so the loop never leaves the accelerator.
Decoding runs ``block`` steps in one compiled ``fori_loop`` per call; the host only sees each finished
block (that is where tokens are streamed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.engine.prefill import check_ced_cut, default_ced_cut
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_device import DeviceEngram, device_history_init, device_row_ids
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.sharding import named_shardings, state_partition_specs

SERVE_BATCH = ("data", "expert")  # mesh axes the sequences of a batch are split over when serving


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = (1,)
    prefill_chunk: int = 512
    prefill_mode: str = "exact"  # or "ced"
    block: int = 16  # decode steps per compiled call


def sample_logits(logits: Float[Array, "B V"], keys: Array, cfg: SamplingConfig) -> Int[Array, "B"]:
    """Greedy, or temperature sampling restricted to the top-k and the top-p nucleus (per-sequence keys)."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), axis=-1)
        cut = jnp.cumsum(probs, axis=-1) - probs >= cfg.top_p  # keep the smallest prefix reaching top_p
        masked = jnp.where(cut, -jnp.inf, jnp.take_along_axis(logits, order, -1))
        logits = jnp.zeros_like(logits).at[jnp.arange(logits.shape[0])[:, None], order].set(masked)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


class DecodeState(NamedTuple):
    cache: C.Cache
    logits: Array  # [B, V] of the last fed token
    history: Array  # Engram history [B, J-1]
    n_seen: Array  # [B]
    done: Array  # [B] bool
    keys: Array  # [B] per-sequence PRNG keys
    step: Array  # scalar


class Generator:
    """Compiled prefill and decode for one model, batch size and ``max_seq_len``."""

    def __init__(self, model: Transformer, tables: DeviceEngram, batch: int, max_seq_len: int,
                 sampling: SamplingConfig, mesh: jax.sharding.Mesh | None = None):
        """``mesh``: place the weights by the sharding table (experts over ``expert``, ...), split the
        sequences over ``data``×``expert`` where the batch divides, and run MoE layers expert-parallel."""
        self.cfg, self.tables, self.batch = model.cfg, tables, batch
        self.max_seq_len, self.sampling, self.mesh = max_seq_len, sampling, mesh
        graphdef, state = nnx.split(model)
        if mesh is not None:
            state = jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh)))
        self.state = state
        # (options of non-final chunks, options of the final chunk)
        self._chunk_options = (ChunkOptions(), ChunkOptions())
        if sampling.prefill_mode == "ced":
            cut = default_ced_cut(model.cfg)
            check_ced_cut(model.cfg, cut)
            if sampling.prefill_chunk < model.cfg.attention.window_size:
                raise ValueError(f"CED prefill needs prefill_chunk ≥ window ({model.cfg.attention.window_size})")
            self._chunk_options = (ChunkOptions(skip_from=cut), ChunkOptions(ced_cut=cut))
        elif sampling.prefill_mode != "exact":
            raise ValueError(f"prefill_mode must be 'exact' or 'ced', got {sampling.prefill_mode!r}")

        def prefill_chunk(state, cache, history, n_seen, tokens, n_new, opts):
            rows, _, _ = device_row_ids(tables, history, n_seen, tokens)  # padding rows: computed, never used
            with expert_parallel(mesh):
                logits, cache = forward_chunk(nnx.merge(graphdef, state), cache, tokens, rows, n_new,
                                              options=opts)
            return logits, cache, *_advance_history(tables, history, n_seen, tokens, n_new)

        def decode_block(state, s):
            with expert_parallel(mesh):
                return self._decode_block(nnx.merge(graphdef, state), s)

        self._prefill = jax.jit(prefill_chunk, static_argnums=6)
        self._decode = jax.jit(decode_block)

    def _decode_block(self, model: Transformer, s: DecodeState):
        cfg, b = self.sampling, self.batch
        stop = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)

        def body(i, carry):
            s, out = carry
            keys = jax.vmap(jax.random.fold_in, (0, None))(s.keys, s.step)
            token = jnp.where(s.done, -1, sample_logits(s.logits, keys, cfg))
            fed = jnp.maximum(token, 0)
            rows, history, n_seen = device_row_ids(self.tables, s.history, s.n_seen, fed[:, None])
            n_new = (~s.done).astype(jnp.int32)
            logits, cache = forward_chunk(model, s.cache, fed[:, None], rows, n_new)
            done = s.done | jnp.isin(token, stop) | (cache.lengths >= self.max_seq_len)
            done = done | (s.step + 1 >= cfg.max_new_tokens)
            s = DecodeState(cache, logits, jnp.where(s.done[:, None], s.history, history),
                            jnp.where(s.done, s.n_seen, n_seen), done, s.keys, s.step + 1)
            return s, out.at[:, i].set(token)

        return jax.lax.fori_loop(0, cfg.block, body, (s, jnp.full((b, cfg.block), -1, jnp.int32)))

    def prefill(self, prompts: list[list[int]]) -> DecodeState:
        """Chunked prefill of ragged prompts (token ids); validates them first.

        Prompts are right-aligned on the chunk grid, so every sequence ends in the final chunk: CED runs the
        layers after its cut only there, on each sequence's last ``window`` tokens.
        """
        validate_prompts(prompts, self.batch, self.cfg.vocab_size, self.max_seq_len)
        lengths = np.array([len(p) for p in prompts])
        chunk = self.sampling.prefill_chunk
        n_chunks = -(-int(lengths.max()) // chunk)
        cache = C.init_cache(self.cfg, self.batch, self.max_seq_len)
        if self.mesh is not None:
            cache = jax.device_put(cache, named_shardings(self.mesh, C.cache_partition_specs(cache, self.mesh,
                                                                                      batch_axis=SERVE_BATCH)))
        history, n_seen = device_history_init(self.tables, self.batch)
        logits = None
        for k in range(n_chunks):
            hi = lengths - (n_chunks - 1 - k) * chunk  # exclusive end of each row's slice in this chunk
            lo = np.maximum(hi - chunk, 0)
            n_new = np.maximum(hi - lo, 0)
            tokens = np.zeros((self.batch, chunk), np.int32)
            for i, p in enumerate(prompts):
                tokens[i, : n_new[i]] = p[lo[i]: lo[i] + n_new[i]]
            opts = self._chunk_options[k == n_chunks - 1]
            logits, cache, history, n_seen = self._prefill(self.state, cache, history, n_seen, jnp.asarray(tokens),
                                                           jnp.asarray(n_new, jnp.int32), opts)
        return DecodeState(cache, logits, history, n_seen, jnp.zeros((self.batch,), bool),
                           jax.random.split(jax.random.key(0), self.batch), jnp.int32(0))

    def stream(self, prompts: list[list[int]], seed: int = 0) -> Iterator[np.ndarray]:
        """Yields [B, ≤block] new tokens (−1 = finished) block by block until every sequence stops."""
        s = self.prefill(prompts)
        s = s._replace(keys=jax.random.split(jax.random.key(seed), self.batch))
        while not bool(s.done.all()):
            s, out = self._decode(self.state, s)
            yield np.asarray(out)

    def generate(self, prompts: list[list[int]], seed: int = 0,
                 on_block: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
        outs = [[] for _ in prompts]
        for block in self.stream(prompts, seed):
            if on_block is not None:
                on_block(block)
            for i, row in enumerate(block):
                outs[i].extend(int(t) for t in row if t >= 0)
        return outs


def _advance_history(tables: DeviceEngram, history: Array, n_seen: Array, tokens: Array, n_new: Array):
    """The Engram history after the first ``n_new[b]`` tokens of a ragged chunk (padding is never history)."""
    ext = jnp.concatenate([history, tables.token_map[tokens]], axis=1)  # [B, J-1+S]
    idx = n_new[:, None] + jnp.arange(history.shape[1])[None]
    return jnp.take_along_axis(ext, idx, axis=1), n_seen + n_new


def validate_prompts(prompts, batch: int, vocab: int, max_seq_len: int) -> None:
    """A ValueError naming the first prompt that cannot be generated from (empty, too long, ids out of range)."""
    if len(prompts) != batch:
        raise ValueError(f"got {len(prompts)} prompts for a generator of batch {batch}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS)")
        if len(p) >= max_seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; max_seq_len is {max_seq_len} (room to generate needed)")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
