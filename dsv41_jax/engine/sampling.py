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
from dsv41_jax.engine.speculative import STATS, SpecState, speculative_step
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_device import DeviceEngram, advance_history, device_history_init, device_row_ids
from dsv41_jax.model.dspark import DraftCache, DSpark, init_draft_cache
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
    speculative: int = 0  # DSpark drafts verified per step (spec model §8.4); 0 = plain decoding
    # the target's steps per second at n verified tokens in a batch (sps[n]): confidence-scheduled verify
    # lengths (engine.speculative.schedule_verify); empty = every request verifies `speculative` drafts
    sps: tuple[float, ...] = ()


def sample_logits(logits: Float[Array, "B V"], keys: Array, cfg: SamplingConfig) -> Int[Array, "B"]:
    """Greedy, or temperature sampling restricted to the top-k and the top-p nucleus (per-sequence keys)."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, cfg)).astype(jnp.int32)


def filtered_logits(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Float[Array, "B V"]:
    """The logits of the distribution a request samples from: temperature, then top-k and top-p (−∞ outside)."""
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
    return logits


class DecodeState(NamedTuple):
    cache: C.Cache
    logits: Array  # [B, V] of the last fed token
    history: Array  # Engram history [B, J-1]
    n_seen: Array  # [B]
    done: Array  # [B] bool
    keys: Array  # [B] per-sequence PRNG keys
    step: Array  # scalar
    draft: DraftCache | None = None  # the DSpark drafter's rings, with speculative decoding


class Generator:
    """Compiled prefill and decode for one model, batch size and ``max_seq_len``."""

    def __init__(self, model: Transformer, tables: DeviceEngram, batch: int, max_seq_len: int,
                 sampling: SamplingConfig, mesh: jax.sharding.Mesh | None = None, drafter: DSpark | None = None):
        """``mesh``: place the weights by the sharding table (experts over ``expert``, ...), split the
        sequences over ``data``×``expert`` where the batch divides, and run MoE layers expert-parallel.
        ``drafter`` with ``sampling.speculative`` > 0: speculative decoding (``engine.speculative``); the
        acceptance counts of the last generation are in :attr:`stats`."""
        self.cfg, self.tables, self.batch = model.cfg, tables, batch
        self.max_seq_len, self.sampling, self.mesh = max_seq_len, sampling, mesh
        self.stats: dict[str, np.ndarray] = {}
        graphdef, state = nnx.split(model)
        if mesh is not None:
            state = jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh)))
        self.state = state
        if sampling.speculative:
            check_speculative(model.cfg, sampling, drafter)
            if mesh is not None:
                raise SpeculativeError("speculative decoding runs on one device: the drafter is not placed on a mesh")
        dgraph, self.dstate = nnx.split(drafter) if sampling.speculative else (None, None)
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

        def prefill_chunk(state, dstate, cache, dcache, history, n_seen, tokens, n_new, opts):
            rows, _, _ = device_row_ids(tables, history, n_seen, tokens)  # padding rows: computed, never used
            observe = dstate is not None and opts.skip_from is None  # the drafter sees the rows that reach it
            with expert_parallel(mesh):
                out = forward_chunk(nnx.merge(graphdef, state), cache, tokens, rows, n_new,
                                    options=opts._replace(main_hidden=observe))
            if observe:
                f = out[2]
                dcache = nnx.merge(dgraph, dstate).observe(dcache, f.main_hidden, f.pos, f.valid)
            return out[0], out[1], dcache, *advance_history(tables, history, n_seen, tokens, n_new)

        def decode_block(state, s):
            with expert_parallel(mesh):
                return self._decode_block(nnx.merge(graphdef, state), s)

        def speculative_block(state, dstate, s):
            with expert_parallel(mesh):
                return self._speculative_block(nnx.merge(graphdef, state), nnx.merge(dgraph, dstate), s)

        self._prefill = jax.jit(prefill_chunk, static_argnums=8)
        self._decode = jax.jit(decode_block)
        self._speculative = jax.jit(speculative_block)

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
                            jnp.where(s.done, s.n_seen, n_seen), done, s.keys, s.step + 1, s.draft)
            return s, out.at[:, i].set(token)

        return jax.lax.fori_loop(0, cfg.block, body, (s, jnp.full((b, cfg.block), -1, jnp.int32)))

    def _speculative_block(self, model: Transformer, drafter: DSpark, s: SpecState):
        cfg, k = self.sampling, self.sampling.speculative
        stop = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)

        def body(i, carry):
            s, out = carry
            s, tokens = speculative_step(model, drafter, self.tables, s, k=k, temperature=cfg.temperature,
                                         filtered=lambda x: filtered_logits(x, cfg), stop=stop,
                                         max_new_tokens=cfg.max_new_tokens, max_seq_len=self.max_seq_len,
                                         sps=cfg.sps)
            return s, out.at[:, i].set(tokens)

        return jax.lax.fori_loop(0, cfg.block, body, (s, jnp.full((self.batch, cfg.block, k + 1), -1, jnp.int32)))

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
        dcache = init_draft_cache(self.cfg, self.batch) if self.dstate is not None else None
        logits = None
        for k in range(n_chunks):
            hi = lengths - (n_chunks - 1 - k) * chunk  # exclusive end of each row's slice in this chunk
            lo = np.maximum(hi - chunk, 0)
            n_new = np.maximum(hi - lo, 0)
            tokens = np.zeros((self.batch, chunk), np.int32)
            for i, p in enumerate(prompts):
                tokens[i, : n_new[i]] = p[lo[i]: lo[i] + n_new[i]]
            opts = self._chunk_options[k == n_chunks - 1]
            logits, cache, dcache, history, n_seen = self._prefill(
                self.state, self.dstate, cache, dcache, history, n_seen, jnp.asarray(tokens),
                jnp.asarray(n_new, jnp.int32), opts)
        return DecodeState(cache, logits, history, n_seen, jnp.zeros((self.batch,), bool),
                           jax.random.split(jax.random.key(0), self.batch), jnp.int32(0), dcache)

    def stream(self, prompts: list[list[int]], seed: int = 0, speculative: bool = True) -> Iterator[np.ndarray]:
        """Yields [B, n] new tokens (−1 = none: finished, or not emitted by a speculative step) block by block
        until every sequence stops; n = ``block`` (``block · (speculative + 1)`` with speculative decoding).
        ``speculative=False`` decodes plainly even where the generator has a drafter."""
        s = self.prefill(prompts)
        s = s._replace(keys=jax.random.split(jax.random.key(seed), self.batch))
        if self.sampling.speculative and speculative:
            yield from self._stream_speculative(s)
            return
        while not bool(s.done.all()):
            s, out = self.decode_block(s)
            yield out

    def decode_block(self, s: DecodeState) -> tuple[DecodeState, np.ndarray]:
        """``block`` compiled plain decode steps: the state and the new tokens [B, block] (−1 = finished)."""
        s, out = self._decode(self.state, s)
        return s, np.asarray(out)

    def _stream_speculative(self, s: DecodeState) -> Iterator[np.ndarray]:
        spec = self.start_speculative(s)
        while not bool(spec.done.all()):
            spec, out = self.speculative_block(spec)
            yield out

    def start_speculative(self, s: DecodeState) -> SpecState:
        """Speculative decoding's state after a prefill: the pending token sampled from the prefill's logits."""
        keys = jax.vmap(jax.random.fold_in, (0, None))(s.keys, s.step)  # plain decoding's first draw
        token = sample_logits(s.logits, keys, self.sampling)
        zeros = jnp.zeros((self.batch,), jnp.int32)
        return SpecState(s.cache, s.draft, token, s.history, s.n_seen, s.done, s.keys, s.step + 1, zeros,
                         jnp.zeros((self.batch, len(STATS)), jnp.int32))

    def speculative_block(self, spec: SpecState) -> tuple[SpecState, np.ndarray]:
        """``block`` compiled draft-verify-commit steps: the state and the emitted tokens [B, block · (k+1)]
        (−1 = none); :attr:`stats` then holds each sequence's counts so far (``STATS``)."""
        spec, out = self._speculative(self.state, self.dstate, spec)
        self.stats = dict(zip(STATS, np.asarray(spec.stats).T, strict=True))
        return spec, np.asarray(out).reshape(self.batch, -1)

    def generate(self, prompts: list[list[int]], seed: int = 0,
                 on_block: Callable[[np.ndarray], None] | None = None, speculative: bool = True) -> list[list[int]]:
        outs = [[] for _ in prompts]
        for block in self.stream(prompts, seed, speculative):
            if on_block is not None:
                on_block(block)
            for i, row in enumerate(block):
                outs[i].extend(int(t) for t in row if t >= 0)
        return outs


class SpeculativeError(ValueError):
    """Speculative decoding that cannot run as asked (no drafter, too many drafts, ...)."""


def check_speculative(cfg, sampling: SamplingConfig, drafter: DSpark | None) -> None:
    """A :class:`SpeculativeError` naming what cannot run with ``sampling.speculative`` drafts per step."""
    k = sampling.speculative
    if drafter is None:
        raise SpeculativeError("speculative decoding needs the DSpark drafter (the checkpoint's mtp.* stages)")
    if not 1 <= k <= cfg.dspark.block_size:
        raise SpeculativeError(f"{k} drafts per step; the drafter drafts 1..{cfg.dspark.block_size}")
    if k + 1 > cfg.attention.window_size:
        raise SpeculativeError(f"a verify chunk of {k + 1} tokens exceeds the window ({cfg.attention.window_size})")
    if sampling.prefill_mode == "ced" and min(cfg.dspark.target_layer_ids) < default_ced_cut(cfg):
        raise SpeculativeError(f"CED prefill: the DSpark target layers {cfg.dspark.target_layer_ids} must come "
                               f"after the cut ({default_ced_cut(cfg)}), where every row of the drafter's window "
                               "is kept")


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
