"""Continuous batching: one thread drives the engine's batch rows; requests join and leave between decode blocks.

Each loop: take new requests, drop cancelled ones (their rows are freed), admit waiting requests into free rows
(one ragged prefill of all of them, :class:`~dsv41_jax.engine.sampling.AdmissionPlan`, running rows untouched)
one chunk at a time, and run one compiled decode block over the running rows between chunks, handing each
request its new text: a long prompt never stalls the streams already running. Sampling settings are per-row
arrays, so no request ever compiles anything: the shapes are the prefill chunk and the decode block, built at
start-up.

An image prompt comes with its token types and span embeddings (:mod:`dsv41_jax.serve.images`); rows and cache
entries hold a sequence's cache keys (its token ids, image spans keyed by their pixels), never the bare ids.

A finished row keeps its state (the **device tier** of the prefix cache): a request that continues that exact
sequence resumes in place with its SWA window live. When the row is needed by someone else, its global KV is
already in the host (and disk) tier with its rings in the SWA pool, written when it finished
(:mod:`dsv41_jax.serve.prefix_cache`). A host or disk hit restores global KV into a row and resumes directly if
the rings are still live, else replays the prefix's last ``window`` tokens (encoder bounded replay, spec
attention §9.4); a miss runs the configured prefill (CED or exact).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from tokenizers import Tokenizer

from dsv41_jax import cache as C
from dsv41_jax.engine.sampling import Admission, AdmissionPlan, Generator
from dsv41_jax.serve.metrics import Metrics
from dsv41_jax.serve.prefix_cache import BLOCK, Entry, PrefixCache
from dsv41_jax.serve.text import TextStream


class Overloaded(Exception):
    """The queue is full (429) or the engine is not running (503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class Update:
    """New output of one request: text, ids and, when asked, per-token logprobs (lp, [(id, lp), ...])."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new: int
    emit: Callable[[Update], None]  # called from the scheduler thread
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs
    salt: str = ""  # cache_salt: prefix-cache entries are shared only between requests of one salt
    token_types: np.ndarray | None = None  # an image prompt's token types (dsv41_jax.vision.spans) ...
    image_embeds: jax.Array | None = None  # ... its span embeddings [len(prompt), D] ...
    keys: np.ndarray | None = None  # ... and its prefix-cache keys (dsv41_jax.serve.images.cache_keys)
    cancelled: bool = False
    arrival: float = field(default_factory=time.monotonic)
    generated: int = 0
    last_emit: float | None = None
    text: TextStream | None = None

    @property
    def cache_keys(self) -> np.ndarray:
        """int64 [len(prompt)]: the prompt as the prefix cache keys it (its ids; image spans by content)."""
        return np.asarray(self.prompt, np.int64) if self.keys is None else self.keys


@dataclass
class Row:
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)  # the cache keys of what the row's cache holds
    parked: bool = False  # finished, its state kept (device tier)
    active: bool = False  # prefilled: decoding
    salt: str = ""
    used: float = 0.0


def _take_row(cache: C.Cache, row):
    return (tuple(tuple(x[row] for x in s) for s in cache.sources),
            tuple(tuple(x[row] for x in r) for r in cache.rings))


def _put_row(cache: C.Cache, row, sources, rings):
    srcs = tuple(C.SourceCache(*(x.at[row].set(v) for x, v in zip(s, new, strict=True)))
                 for s, new in zip(cache.sources, sources, strict=True))
    if rings is not None:
        cache = cache._replace(rings=tuple(C.RingCache(*(x.at[row].set(v) for x, v in zip(r, new, strict=True)))
                                           for r, new in zip(cache.rings, rings, strict=True)))
    return cache._replace(sources=srcs)


class Scheduler:
    def __init__(self, gen: Generator, tok: Tokenizer, metrics: Metrics, *, eos: int, max_queue: int,
                 prefix_cache: PrefixCache | None, log: Callable[[str], None] = print):
        self.gen, self.tok, self.metrics, self.eos, self.max_queue = gen, tok, metrics, eos, max_queue
        self.cache, self.log = prefix_cache, log
        self.window = gen.cfg.attention.window_size
        self.ratios = [gen.cfg.attention.compress_ratios[s] for s in gen.cfg.attention.kv_source_layers]
        self.state = gen.empty()
        self.rows = [Row() for _ in range(gen.batch)]
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: deque[Request] = deque()
        self.wake = threading.Event()
        self.error: str | None = None
        self.admitting: tuple[AdmissionPlan, int] | None = None  # the prefill under way and its next chunk
        self._stop = False
        self._take = jax.jit(_take_row)
        self._put = jax.jit(_put_row, donate_argnums=0)
        self.thread = threading.Thread(target=self._run, name="dsv41-scheduler", daemon=True)

    # -- called from the server's event loop
    def submit(self, req: Request) -> None:
        if self.error is not None or not self.thread.is_alive():
            raise Overloaded(f"the engine is not running: {self.error or 'stopped'}", 503)
        if len(self.waiting) + self.inbox.qsize() >= self.max_queue:
            self.metrics.rejected.inc()
            raise Overloaded(f"{self.max_queue} requests are already waiting; retry later", 429)
        self.inbox.put(req)
        self.wake.set()

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        self.wake.set()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self.thread.join(timeout=30)
        if self.cache is not None:
            self.cache.flush()

    # -- start-up
    def warm_up(self) -> None:
        """Compile every shape the server runs (prefill chunks, decode block, row transfers), with progress."""
        chunk, t0 = self.gen.sampling.prefill_chunk, time.monotonic()
        prompt = [0] * min(chunk + 1, self.gen.max_seq_len - 1)  # two chunks: CED's non-final and final
        self.log(f"compiling: prefill ({self.gen.batch} rows × {chunk} tokens, {self.gen.sampling.prefill_mode})")
        s = self.gen.admit(self.gen.empty(), [Admission(0, prompt, sampling=(0.0, 0, 1.0, 1))])
        jax.block_until_ready(s.logits)
        self.log(f"compiling: decode block ({self.gen.sampling.block} steps) [{time.monotonic() - t0:.1f} s]")
        s, out = self.gen.decode(s)
        jax.block_until_ready(out.tokens)
        self.log(f"compiling: row transfers [{time.monotonic() - t0:.1f} s]")
        sources, rings = jax.device_get(self._take(s.cache, 0))
        self._put(self._put(s.cache, 0, sources, rings), 0, sources, None)
        self.log(f"compiled in {time.monotonic() - t0:.1f} s")

    # -- the loop
    def _run(self) -> None:
        try:
            while not self._stop:
                self._take_inbox()
                self._drop_cancelled()
                if self.admitting is None:
                    self._admit()
                if self.admitting is not None:
                    self._prefill_chunk()
                if any(r.active for r in self.rows):
                    self._decode()
                elif self.admitting is None:
                    self.wake.wait(0.05)
                    self.wake.clear()
                self.metrics.occupancy.set(sum(r.request is not None for r in self.rows))
                self.metrics.waiting.set(len(self.waiting) + self.inbox.qsize())
        except Exception as err:  # the engine failed: every request gets the error, the server answers 503
            self.error = f"{type(err).__name__}: {err}"
            self.log(f"error: scheduler stopped: {self.error}")
            for req in [r.request for r in self.rows if r.request] + list(self.waiting):
                req.emit(Update("", [], [], finish_reason="error", error=self.error))
            raise

    def _take_inbox(self) -> None:
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self.metrics.cancelled.inc()
        for i, row in enumerate(self.rows):
            if row.active and row.request.cancelled:
                self.metrics.cancelled.inc()
                self._finish(i, None)

    def _admit(self) -> None:
        admissions = []
        while self.waiting:
            req = self.waiting[0]
            admission = self._place(req)
            if admission is None:
                break
            self.waiting.popleft()
            req.text = TextStream(self.tok, req.stops)
            self.rows[admission.row] = Row(req, req.cache_keys.tolist(), salt=req.salt)
            seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(4), "little")
            admissions.append(Admission(admission.row, req.prompt, admission.start, admission.replay_hit,
                                        (req.temperature, req.top_k, req.top_p, req.max_new), seed,
                                        token_types=req.token_types, image_embeds=req.image_embeds))
            self.metrics.prompt_tokens.inc(len(req.prompt))
        if admissions:
            plan = self.gen.plan(admissions)
            self.state, self.admitting = plan.begin(self.state), (plan, 0)

    def _prefill_chunk(self) -> None:
        plan, k = self.admitting
        self.state = plan.chunk(self.state, k)
        self.admitting = (plan, k + 1) if k + 1 < plan.n_chunks else None
        if self.admitting is None:
            for a in plan.admissions:
                self.rows[a.row].active = True

    def _place(self, req: Request) -> Admission | None:
        """A row for ``req`` and where its prefill starts: a device, host or disk hit, or a miss."""
        prompt = req.cache_keys
        best = None
        for i, row in enumerate(self.rows):  # device tier: a finished row that ``prompt`` continues
            n = len(row.tokens)
            longer = best is None or n > len(self.rows[best].tokens)
            if row.parked and row.salt == req.salt and n < len(prompt) and longer \
                    and np.array_equal(np.asarray(row.tokens, np.int64), prompt[:n]):
                best = i
        if best is not None:
            self.metrics.hit("device", "live")
            return Admission(best, req.prompt, start=len(self.rows[best].tokens))
        free = [i for i, r in enumerate(self.rows) if r.request is None]
        if not free:
            return None
        row = min(free, key=lambda i: (self.rows[i].parked, self.rows[i].used))  # empty rows first, then LRU
        self.rows[row] = Row()
        hit = self.cache.lookup(prompt, len(prompt) - 1, req.salt) if self.cache is not None else None
        if hit is not None and (hit.rings is not None or hit.length > self.window):
            sources = self._full_sources(hit.entry)
            rings = None if hit.rings is None else [tuple(hit.rings[2 * k: 2 * k + 2])
                                                    for k in range(len(hit.rings) // 2)]
            self.state = self.state._replace(cache=self._put(self.state.cache, row, sources, rings))
            if rings is not None:
                self.metrics.hit(hit.tier, "live")
                return Admission(row, req.prompt, start=hit.length)
            self.metrics.hit(hit.tier, "replay")
            return Admission(row, req.prompt, start=hit.length - self.window, replay_hit=hit.length)
        self.metrics.miss.inc()
        return Admission(row, req.prompt)

    def _full_sources(self, entry: Entry) -> list[tuple[np.ndarray, ...]]:
        """An entry's arrays padded to the cache's entry count (one compiled row write for every length)."""
        out = []
        for k, src in enumerate(self.state.cache.sources):
            arrays = entry.arrays[6 * k: 6 * k + 6]
            fields = []
            for buf, arr in zip(src[:4], arrays[:4], strict=True):
                full = np.zeros(buf.shape[1:], arr.dtype)
                full[: len(arr)] = arr
                fields.append(full)
            out.append((*fields, *arrays[4:]))
        return out

    def _decode(self) -> None:
        self.state, block = self.gen.decode(self.state)
        tokens, logprobs, top_ids, top_lps, done = jax.device_get(
            (block.tokens, block.logprobs, block.top_ids, block.top_logprobs, self.state.done))
        now = time.monotonic()
        for i, row in enumerate(self.rows):
            req = row.request
            if not row.active:
                continue
            text, ids, lps, reason = "", [], [], None
            for j, t in enumerate(int(x) for x in tokens[i]):
                if t < 0:
                    break
                row.tokens.append(t)  # fed to the cache, also after a stop string
                if reason is not None:
                    continue
                req.generated += 1
                ids.append(t)
                if req.top_logprobs is not None:
                    lps.append((float(logprobs[i, j]), [(int(a), float(b)) for a, b in
                                                       zip(top_ids[i, j, :req.top_logprobs],
                                                           top_lps[i, j, :req.top_logprobs], strict=True)]))
                if t == self.eos:
                    reason = "stop"
                    continue
                text += req.text.push(t)
                if req.text.stopped:
                    reason = "stop"
                elif req.generated >= req.max_new:
                    reason = "length"
            if reason is None and done[i]:
                reason = "length"  # max_new or max_seq_len reached on the device
            self._observe(req, len(ids), now)
            if reason is not None:
                text += req.text.finish()
            req.emit(Update(text, ids, lps, reason, prompt_tokens=len(req.prompt), completion_tokens=req.generated))
            if reason is not None:
                self._finish(i, reason)

    def _observe(self, req: Request, n: int, now: float) -> None:
        if n == 0:
            return
        if req.last_emit is None:
            self.metrics.ttft.observe(now - req.arrival)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - req.last_emit) / n)
        req.last_emit = now
        self.metrics.generation_tokens.inc(n)

    def _finish(self, i: int, reason: str | None) -> None:
        """Free row ``i``: the device stops it; its state stays as the device tier and goes to the host tier."""
        row = self.rows[i]
        self.metrics.requests.labels(finish=reason or "cancelled").inc()
        self.state = self.state._replace(done=self.state.done.at[i].set(True))
        row.request, row.parked, row.active, row.used = None, True, False, time.monotonic()
        if self.cache is not None and len(row.tokens) >= BLOCK:
            sources, rings = jax.device_get(self._take(self.state.cache, i))
            n = len(row.tokens)
            arrays = []
            for m, src in zip(self.ratios, sources, strict=True):
                t = -(-n // m)
                arrays += [a[:t] for a in src[:4]] + list(src[4:])
            self.cache.put(Entry(np.asarray(row.tokens, np.int64), arrays, row.salt), [x for r in rings for x in r])
            self.metrics.cache_bytes(self.cache.tier_bytes())

