"""Generation: chunked prefill, then a jit-compiled decode loop (no Python per token) with sampling.

Engram row ids are hashed on the device (``engram_device``) so the loop never leaves the accelerator.
Decoding runs ``block`` steps in one compiled ``fori_loop`` per call; the host only sees each finished
block (that is where tokens are streamed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.engine.prefill import check_ced_cut, default_ced_cut
from dsv41_jax.engine.speculative import STATS, SpecState, speculative_step, verify_widths
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_device import DeviceEngram, advance_history, device_history_init, device_row_ids
from dsv41_jax.engram_hash import DEAD
from dsv41_jax.model.dspark import DraftCache, DSpark, init_draft_cache
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.sharding import named_shardings, state_partition_specs

Prompts = Sequence[Sequence[int | np.integer]]  # token ids per request (Python or NumPy integers)

if TYPE_CHECKING:
    from dsv41_jax.vision.prompt import PromptInputs

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
    # the verify chunk's compiled widths (rows per request; engine.speculative.verify_widths); empty: k + 1,
    # and with `sps` the powers of two below it too
    verify_widths: tuple[int, ...] = ()


class RowSampling(NamedTuple):
    """Sampling settings per sequence, as arrays: one compiled decode serves any mix of requests."""

    temperature: Float[Array, "B"]  # 0 = greedy
    top_k: Int[Array, "B"]  # 0 = off
    top_p: Float[Array, "B"]  # 1 = off
    max_new: Int[Array, "B"]  # tokens to generate

    @classmethod
    def of(cls, cfg: SamplingConfig, batch: int) -> RowSampling:
        return cls(jnp.full((batch,), cfg.temperature, jnp.float32), jnp.full((batch,), cfg.top_k, jnp.int32),
                   jnp.full((batch,), cfg.top_p, jnp.float32), jnp.full((batch,), cfg.max_new_tokens, jnp.int32))


def sample_logits(logits: Float[Array, "B V"], keys: Array, cfg: SamplingConfig) -> Int[Array, "B"]:
    """Greedy, or temperature sampling restricted to the top-k and the top-p nucleus (per-sequence keys)."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, cfg)).astype(jnp.int32)


def sample_rows(logits: Float[Array, "B V"], keys: Array, rows: RowSampling) -> Int[Array, "B"]:
    """:func:`sample_logits` with each sequence's own settings (greedy where its temperature is 0)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    hot = rows.temperature > 0

    def draw():
        return jax.vmap(jax.random.categorical)(keys, filtered_rows(logits, rows)).astype(jnp.int32)

    return jnp.where(hot, jax.lax.cond(hot.any(), draw, lambda: greedy), greedy)


def filtered_logits(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Float[Array, "B V"]:
    """The logits of the distribution a request samples from: temperature, then top-k and top-p (−∞ outside)."""
    if not cfg.top_k and cfg.top_p >= 1.0:
        return logits.astype(jnp.float32) / cfg.temperature
    return filtered_rows(logits, RowSampling.of(cfg, logits.shape[0]))


def filtered_rows(logits: Float[Array, "B V"], rows: RowSampling) -> Float[Array, "B V"]:
    """:func:`filtered_logits` per sequence: its temperature (0 counts as 1), its top-k (ties broken lower index
    first, as ``lax.top_k``), then the smallest prefix whose probability reaches its top-p."""
    scaled = logits.astype(jnp.float32) / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]

    def restrict():
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # [B, V] descending, lower index first among ties
        ranked = jnp.take_along_axis(scaled, order, -1)
        rank = jnp.arange(scaled.shape[-1])[None]
        ranked = jnp.where((rows.top_k[:, None] <= 0) | (rank < rows.top_k[:, None]), ranked, -jnp.inf)
        probs = jax.nn.softmax(ranked, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1.0)
        masked = jnp.where(keep, ranked, -jnp.inf)
        return jnp.zeros_like(scaled).at[jnp.arange(scaled.shape[0])[:, None], order].set(masked)

    return jax.lax.cond(((rows.top_k > 0) | (rows.top_p < 1.0)).any(), restrict, lambda: scaled)


class DecodeState(NamedTuple):
    cache: C.Cache
    logits: Array  # [B, V] of the last fed token
    history: Array  # Engram history [B, J-1]
    n_seen: Array  # [B]
    done: Array  # [B] bool
    keys: Array  # [B] per-sequence PRNG keys
    step: Array  # [B] tokens generated so far
    rows: RowSampling
    draft: DraftCache | None = None  # the DSpark drafter's rings, with speculative decoding


class Block(NamedTuple):
    """What one compiled decode block produced, per sequence and step (−1 / 0 once a sequence has stopped)."""

    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]  # the model's log-softmax at each token
    top_ids: Int[Array, "B N K"]  # the K most likely ids (K = Generator.top_logprobs) ...
    top_logprobs: Float[Array, "B N K"]  # ... and their log-probabilities


class Generator:
    """Compiled prefill and decode for one model, batch size and ``max_seq_len``.

    :meth:`generate` / :meth:`stream` run one fixed batch. A server keeps one :class:`DecodeState` for the
    batch's rows and calls :meth:`admit` (prefill new sequences into free rows, the running ones untouched)
    and :meth:`decode` (one compiled block over every row) in turn: sequences join and leave between blocks.
    """

    def __init__(self, model: Transformer, tables: DeviceEngram, batch: int, max_seq_len: int,
                 sampling: SamplingConfig, mesh: jax.sharding.Mesh | None = None, drafter: DSpark | None = None,
                 top_logprobs: int = 0):
        """``mesh``: place the weights by the sharding table (experts over ``expert``, ...), split the
        sequences over ``data``×``expert`` where the batch divides, and run MoE layers expert-parallel.
        ``drafter`` with ``sampling.speculative`` > 0: speculative decoding (``engine.speculative``); the
        acceptance counts of the last generation are in :attr:`stats`. ``top_logprobs``: how many most likely
        ids each plain decode step also reports (:class:`Block`)."""
        self.cfg, self.tables, self.batch = model.cfg, tables, batch
        self.max_seq_len, self.sampling, self.mesh, self.top_logprobs = max_seq_len, sampling, mesh, top_logprobs
        self.token_map = np.asarray(tables.token_map)
        self.stats: dict[str, np.ndarray] = {}
        graphdef, state = nnx.split(model)
        if mesh is not None:
            state = jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh)))
        self.state = state
        if sampling.speculative:
            check_speculative(model.cfg, sampling, drafter)
        dgraph, self.dstate = nnx.split(drafter) if sampling.speculative else (None, None)
        if mesh is not None and self.dstate is not None:  # the drafter by the same table (its experts too)
            self.dstate = jax.device_put(self.dstate, named_shardings(mesh, state_partition_specs(self.dstate,
                                                                                                  mesh=mesh)))
        # the steps-per-second table is an argument of the compiled block: another table of its length reuses it
        self.sps = jnp.asarray(sampling.sps, jnp.float32) if sampling.sps else None
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

        def prefill_chunk(state, dstate, cache, dcache, history, n_seen, tokens, n_new, replay_start, write_floor,
                          is_image, image_embeds, opts):
            # padding rows: computed, never used; image-span positions are DEAD for Engram (spec model §6.5)
            rows, _, _ = device_row_ids(tables, history, n_seen, tokens, is_image)
            observe = dstate is not None and opts.skip_from is None  # the drafter sees the rows that reach it
            with expert_parallel(mesh):
                out = forward_chunk(nnx.merge(graphdef, state), cache, tokens, rows, n_new, replay_start=replay_start,
                                    write_floor=write_floor, is_image=is_image, image_embeds=image_embeds,
                                    options=opts._replace(main_hidden=observe))
            if observe:
                f = out[2]
                dcache = nnx.merge(dgraph, dstate).observe(dcache, f.main_hidden, f.pos, f.valid)
            return out[0], out[1], dcache, *advance_history(tables, history, n_seen, tokens, n_new, is_image)

        def decode_block(state, s):
            with expert_parallel(mesh):
                return self._decode_block(nnx.merge(graphdef, state), s)

        def speculative_block(state, dstate, sps, s):
            with expert_parallel(mesh):
                return self._speculative_block(nnx.merge(graphdef, state), nnx.merge(dgraph, dstate), sps, s)

        self._prefill = jax.jit(prefill_chunk, static_argnums=12)
        self._decode = jax.jit(decode_block, donate_argnums=1)
        self._speculative = jax.jit(speculative_block)

    def _decode_block(self, model: Transformer, s: DecodeState) -> tuple[DecodeState, Block]:
        stop = jnp.asarray(self.sampling.stop_tokens or (-1,), jnp.int32)
        b, n, k = self.batch, self.sampling.block, self.top_logprobs

        def body(i, carry):
            s, out = carry
            keys = jax.vmap(jax.random.fold_in)(s.keys, s.step)
            token = jnp.where(s.done, -1, sample_rows(s.logits, keys, s.rows))
            fed = jnp.maximum(token, 0)
            logp = jax.nn.log_softmax(s.logits.astype(jnp.float32), axis=-1)
            top_lp, top_ids = jax.lax.top_k(logp, k)
            rows, history, n_seen = device_row_ids(self.tables, s.history, s.n_seen, fed[:, None])
            n_new = (~s.done).astype(jnp.int32)
            logits, cache = forward_chunk(model, s.cache, fed[:, None], rows, n_new)
            done = s.done | jnp.isin(token, stop) | (cache.lengths >= self.max_seq_len)
            done = done | (s.step + 1 >= s.rows.max_new)
            s = s._replace(cache=cache, logits=logits, history=jnp.where(s.done[:, None], s.history, history),
                           n_seen=jnp.where(s.done, s.n_seen, n_seen), done=done, step=s.step + n_new)
            out = Block(out.tokens.at[:, i].set(token),
                        out.logprobs.at[:, i].set(jnp.take_along_axis(logp, fed[:, None], -1)[:, 0]),
                        out.top_ids.at[:, i].set(top_ids), out.top_logprobs.at[:, i].set(top_lp))
            return s, out

        out = Block(jnp.full((b, n), -1, jnp.int32), jnp.zeros((b, n), jnp.float32),
                    jnp.zeros((b, n, k), jnp.int32), jnp.zeros((b, n, k), jnp.float32))
        return jax.lax.fori_loop(0, n, body, (s, out))

    def _speculative_block(self, model: Transformer, drafter: DSpark, sps: Array | None, s: SpecState):
        cfg, k = self.sampling, self.sampling.speculative
        stop = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
        widths = verify_widths(k, bool(cfg.sps), cfg.verify_widths)

        def body(i, carry):
            s, out = carry
            s, tokens = speculative_step(model, drafter, self.tables, s, k=k, temperature=cfg.temperature,
                                         filtered=lambda x: filtered_logits(x, cfg), stop=stop,
                                         max_new_tokens=cfg.max_new_tokens, max_seq_len=self.max_seq_len,
                                         sps=sps, widths=widths)
            return s, out.at[:, i].set(tokens)

        return jax.lax.fori_loop(0, cfg.block, body, (s, jnp.full((self.batch, cfg.block, k + 1), -1, jnp.int32)))

    def empty(self) -> DecodeState:
        """A state whose every row is free (done)."""
        cache = C.init_cache(self.cfg, self.batch, self.max_seq_len)
        if self.mesh is not None:
            cache = jax.device_put(cache, named_shardings(self.mesh, C.cache_partition_specs(cache, self.mesh,
                                                                                      batch_axis=SERVE_BATCH)))
        history, n_seen = device_history_init(self.tables, self.batch)
        dcache = init_draft_cache(self.cfg, self.batch) if self.dstate is not None else None
        if self.mesh is not None and dcache is not None:  # the drafter's rings split as the cache's are
            split = self.batch % (self.mesh.shape["data"] * self.mesh.shape["expert"]) == 0
            spec = jax.sharding.PartitionSpec(SERVE_BATCH if split else None)
            dcache = jax.device_put(dcache, jax.sharding.NamedSharding(self.mesh, spec))
        return DecodeState(cache, jnp.zeros((self.batch, self.cfg.vocab_size), jnp.float32), history, n_seen,
                           jnp.ones((self.batch,), bool), jax.random.split(jax.random.key(0), self.batch),
                           jnp.zeros((self.batch,), jnp.int32), RowSampling.of(self.sampling, self.batch), dcache)

    def prefill(self, prompts: Prompts, images: PromptInputs | None = None) -> DecodeState:
        """Chunked prefill of ragged prompts (token ids) into a fresh state; validates them first. ``images``
        (:meth:`dsv41_jax.vision.prompt.ImageEncoder.prompt_inputs`) gives the token types and span embeddings
        of image prompts; ``prompts`` are then its expanded ids."""
        validate_prompts(prompts, self.batch, self.cfg.vocab_size, self.max_seq_len)
        if images is None:
            return self.admit(self.empty(), [Admission(i, p) for i, p in enumerate(prompts)])
        _check_images(prompts, images)
        n = images.lengths
        return self.admit(self.empty(), [Admission(i, p, token_types=images.token_types[i, : n[i]],
                                                   image_embeds=images.embeds[i, : n[i]])
                                         for i, p in enumerate(prompts)])

    def admit(self, s: DecodeState, admissions: list[Admission]) -> DecodeState:
        """Prefill each admission's ``tokens[start:]`` into its row (all chunks of :meth:`plan`)."""
        plan = self.plan(admissions)
        s = plan.begin(s)
        for k in range(plan.n_chunks):
            s = plan.chunk(s, k)
        return s

    def plan(self, admissions: list[Admission]) -> AdmissionPlan:
        """The chunked prefill of ``admissions`` into their rows, to run chunk by chunk (a server decodes the
        running rows between chunks)."""
        return AdmissionPlan(self, admissions)

    def history_before(self, tokens: Sequence[int | np.integer], start: int,
                       token_types: np.ndarray | None = None) -> np.ndarray:
        """The Engram history before position ``start`` of ``tokens``: the last J-1 compressed ids, DEAD before 0
        and at image-span positions (``token_types`` ≥ 0)."""
        pos = np.arange(start - (self.tables.mult_limbs.shape[-2] - 1), start)
        ids = np.asarray(tokens, np.int64)[np.maximum(pos, 0)]
        dead = pos < 0
        if token_types is not None:
            dead |= np.asarray(token_types)[np.maximum(pos, 0)] >= 0
        return np.where(dead, DEAD, self.token_map[ids]).astype(np.int32)

    def _image_chunk(self, admissions: list[Admission], lo: np.ndarray, n_new: np.ndarray):
        """(is_image [B, chunk], span embeddings [B, chunk, D]) of this chunk's feeds; (None, None) without
        images (text batches keep their compiled program)."""
        with_images = [a for a in admissions if a.token_types is not None]
        if not with_images:
            return None, None
        chunk = self.sampling.prefill_chunk
        is_image = np.zeros((self.batch, chunk), bool)
        embeds = jnp.zeros((self.batch, chunk, self.cfg.dim), jnp.dtype(self.cfg.dtype))
        for a in with_images:
            j, n = a.start + lo[a.row], n_new[a.row]
            is_image[a.row, :n] = np.asarray(a.token_types[j: j + n]) >= 0
            embeds = embeds.at[a.row, :n].set(a.image_embeds[j: j + n].astype(embeds.dtype))
        if self.mesh is not None:  # the tower ran on one device: the embeddings go where the batch is
            embeds = jax.device_put(embeds, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        return jnp.asarray(is_image), embeds

    def stream(self, prompts: Prompts, seed: int = 0, speculative: bool = True,
               images: PromptInputs | None = None) -> Iterator[np.ndarray]:
        """Yields [B, n] new tokens (−1 = none: finished, or not emitted by a speculative step) block by block
        until every sequence stops; n = ``block`` (``block · (speculative + 1)`` with speculative decoding).
        ``speculative=False`` decodes plainly even where the generator has a drafter; ``images`` as in
        :meth:`prefill`."""
        s = self.prefill(prompts, images)
        s = s._replace(keys=jax.random.split(jax.random.key(seed), self.batch))
        if self.sampling.speculative and speculative:
            yield from self._stream_speculative(s)
            return
        while not bool(s.done.all()):
            s, out = self.decode_block(s)
            yield out

    def decode_block(self, s: DecodeState) -> tuple[DecodeState, np.ndarray]:
        """``block`` compiled plain decode steps: the state and the new tokens [B, block] (−1 = finished)."""
        s, out = self.decode(s)
        return s, np.asarray(out.tokens)

    def decode(self, s: DecodeState) -> tuple[DecodeState, Block]:
        """``block`` compiled plain decode steps over every row (done rows stay as they are), on the device."""
        return self._decode(self.state, s)

    def _stream_speculative(self, s: DecodeState) -> Iterator[np.ndarray]:
        spec = self.start_speculative(s)
        while not bool(spec.done.all()):
            spec, out = self.speculative_block(spec)
            yield out

    def start_speculative(self, s: DecodeState) -> SpecState:
        """Speculative decoding's state after a prefill: the pending token sampled from the prefill's logits."""
        keys = jax.vmap(jax.random.fold_in)(s.keys, s.step)  # plain decoding's first draw
        token = sample_logits(s.logits, keys, self.sampling)
        zeros = jnp.zeros((self.batch,), jnp.int32)
        step = jnp.max(s.step) + 1  # after a prefill every row is at step 0: one scalar step for the batch
        return SpecState(s.cache, s.draft, token, s.history, s.n_seen, s.done, s.keys, step, zeros,
                         jnp.zeros((self.batch, len(STATS)), jnp.int32))

    def speculative_block(self, spec: SpecState) -> tuple[SpecState, np.ndarray]:
        """``block`` compiled draft-verify-commit steps: the state and the emitted tokens [B, block · (k+1)]
        (−1 = none); :attr:`stats` then holds each sequence's counts so far (``STATS``)."""
        spec, out = self._speculative(self.state, self.dstate, self.sps, spec)
        self.stats = dict(zip(STATS, np.asarray(spec.stats).T, strict=True))
        return spec, np.asarray(out).reshape(self.batch, -1)

    def generate(self, prompts: Prompts, seed: int = 0,
                 on_block: Callable[[np.ndarray], None] | None = None, speculative: bool = True,
                 images: PromptInputs | None = None) -> list[list[int]]:
        """Generated ids per prompt; ``images`` as in :meth:`prefill`."""
        outs = [[] for _ in prompts]
        for block in self.stream(prompts, seed, speculative, images):
            if on_block is not None:
                on_block(block)
            for i, row in enumerate(block):
                outs[i].extend(int(t) for t in row if t >= 0)
        return outs


class AdmissionPlan:
    """Prefill of new sequences into chosen rows; the other rows are left as they are.

    A row's cache must already hold its global KV below ``start`` (and its SWA ring, unless the admission
    replays). Feeds are right-aligned on the chunk grid, so every sequence ends in the final chunk: CED runs the
    layers after its cut only there, on each sequence's last ``window`` tokens. :meth:`begin` sets the rows'
    positions (they stay done, so decode blocks between chunks leave them alone); the last :meth:`chunk` gives
    them their logits, sampling settings (default: the generator's), key and step 0, and starts them. An image
    span may cross chunk boundaries: each chunk takes its slice of the span embeddings, and the Engram history
    carries the span's DEAD flags.
    """

    def __init__(self, gen: Generator, admissions: list[Admission]):
        b, chunk = gen.batch, gen.sampling.prefill_chunk
        self.gen, self.admissions = gen, admissions
        self.mask, feed = np.zeros(b, bool), np.zeros(b, np.int64)
        self.start, self.floor, self.replay = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for a in admissions:
            self.mask[a.row], self.start[a.row], feed[a.row] = True, a.start, len(a.tokens) - a.start
            if a.replay_hit is not None:
                self.replay[a.row], self.floor[a.row] = a.start, a.replay_hit
        self.n_chunks = -(-int(feed.max()) // chunk)
        self.tokens, self.n_new = np.zeros((self.n_chunks, b, chunk), np.int32), np.zeros((self.n_chunks, b), np.int32)
        self.lo = np.zeros((self.n_chunks, b), np.int64)
        for k in range(self.n_chunks):
            hi = feed - (self.n_chunks - 1 - k) * chunk  # exclusive end of each row's slice of its feed
            self.lo[k] = np.maximum(hi - chunk, 0)
            self.n_new[k] = np.where(self.mask, np.maximum(hi - self.lo[k], 0), 0)
            for a in admissions:
                j, n = a.start + self.lo[k, a.row], self.n_new[k, a.row]
                self.tokens[k, a.row, :n] = a.tokens[j: j + n]

    def begin(self, s: DecodeState) -> DecodeState:
        history, n_seen = np.asarray(s.history).copy(), np.asarray(s.n_seen).copy()
        for a in self.admissions:
            history[a.row], n_seen[a.row] = self.gen.history_before(a.tokens, a.start, a.token_types), a.start
        lengths = jnp.where(jnp.asarray(self.mask), jnp.asarray(self.start), s.cache.lengths)
        return s._replace(cache=s.cache._replace(lengths=lengths), history=jnp.asarray(history),
                          n_seen=jnp.asarray(n_seen), done=s.done | jnp.asarray(self.mask))

    def chunk(self, s: DecodeState, k: int) -> DecodeState:
        g, last = self.gen, k == self.n_chunks - 1
        is_image, embeds = g._image_chunk(self.admissions, self.lo[k], self.n_new[k])
        new, cache, dcache, history, n_seen = g._prefill(
            g.state, g.dstate, s.cache, s.draft, s.history, s.n_seen, jnp.asarray(self.tokens[k]),
            jnp.asarray(self.n_new[k]), jnp.asarray(self.replay), jnp.asarray(self.floor), is_image, embeds,
            g._chunk_options[last])
        s = s._replace(cache=cache, draft=dcache, history=history, n_seen=n_seen)
        if not last:
            return s
        m = jnp.asarray(self.mask)
        keys, rows = s.keys, s.rows
        for a in self.admissions:
            keys = keys.at[a.row].set(jax.random.split(jax.random.key(a.seed), a.key_rows)[a.key_index])
            if a.sampling is not None:
                rows = RowSampling(*(x.at[a.row].set(v) for x, v in zip(rows, a.sampling, strict=True)))
        return s._replace(logits=jnp.where(m[:, None], new, s.logits), done=s.done & ~m, keys=keys,
                          step=jnp.where(m, 0, s.step), rows=rows)


@dataclass(frozen=True)
class Admission:
    """A sequence entering row ``row``: its tokens are fed from ``start`` (its cache row holds what is before).

    ``replay_hit``: the row holds global KV below this position only; ``start`` is ``replay_hit − window`` and
    the window state is rebuilt by encoder bounded replay (spec attention §9.4). The row's PRNG key is
    ``split(key(seed), key_rows)[key_index]``, as row ``key_index`` of a batch of ``key_rows`` in :meth:`stream`.
    """

    row: int
    tokens: Sequence[int | np.integer]
    start: int = 0
    replay_hit: int | None = None
    sampling: tuple | None = None  # (temperature, top_k, top_p, max_new) of this row
    seed: int = 0
    key_rows: int = 1
    key_index: int = 0
    token_types: np.ndarray | None = None  # [len(tokens)]: an image prompt's types (dsv41_jax.vision.spans) ...
    image_embeds: jax.Array | None = None  # ... and its span embeddings [len(tokens), D]


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
    try:
        verify_widths(k, bool(sampling.sps), sampling.verify_widths)
    except ValueError as err:
        raise SpeculativeError(str(err)) from None
    if sampling.prefill_mode == "ced" and min(cfg.dspark.target_layer_ids) < default_ced_cut(cfg):
        raise SpeculativeError(f"CED prefill: the DSpark target layers {cfg.dspark.target_layer_ids} must come "
                               f"after the cut ({default_ced_cut(cfg)}), where every row of the drafter's window "
                               "is kept")


def _check_images(prompts, images: PromptInputs) -> None:
    for i, p in enumerate(prompts):
        n = int(images.lengths[i])
        if len(p) != n or not np.array_equal(np.asarray(p), images.ids[i, :n]):
            raise ValueError(f"prompt {i} is not the expanded image prompt it comes with (its ids and length must "
                             "be PromptInputs.ids[i, :lengths[i]])")


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
