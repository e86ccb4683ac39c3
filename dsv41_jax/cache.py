"""Inference caches, stored packed exactly as the spec says (spec attention §7.4, §7.5, §8).

Per KV-source layer: main KV as E2M1 nibbles (low nibble = even channel) + E4M3 scales per 16, index keys
as MXFP4 (nibbles + E8M0 per 32), and for ratio-2 sources the fp32 compressor carry of the open group.
Per layer: a ``window``-slot SWA ring in FP8 E4M3 + UE8M0 per 32 (slot = position mod window).
Everything is allocated from ``max_seq_len`` and the batch; nothing is allocated per token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.kv_store import Slots, pytree_dataclass
from dsv41_jax.topology import topology
from pallas_kernels import fp4_pack, index_scan
from pallas_kernels.fp4_pack import reference as fp4_reference
from pallas_kernels.sparse_attention import api as sparse_api


class SourceCache(NamedTuple):
    """Global (compressed) KV of one KV-source layer: entry t covers positions [t·m, t·m + m)."""

    kv_codes: Array  # uint8 [B, T, H/2]
    kv_scales: Array  # float8_e4m3fn [B, T, H/16]
    ik_codes: Array  # uint8 [B, T, I/2]
    ik_exps: Array  # uint8 [B, T, I/32]
    carry_c: Array  # fp32 [B, H]: c_t of the open group's first token (ratio 2; [B, 0] for ratio 1)
    carry_z: Array  # fp32 [B, H]: its gate logits


class RingCache(NamedTuple):
    """One layer's SWA window: slot j holds the newest position ≡ j (mod window)."""

    values: Array  # float8_e4m3fn [B, W, H]
    exps: Array  # uint8 [B, W, H/32]


class Cache(NamedTuple):
    lengths: Int[Array, "B"]  # tokens already in the cache per sequence
    rings: tuple[RingCache, ...]  # one per backbone layer
    sources: tuple[SourceCache, ...]  # one per KV source, in kv_source_layers order


def init_cache(cfg: ModelConfig, batch: int, max_seq_len: int) -> Cache:
    a = cfg.attention
    h, i, w = a.head_dim, a.index_head_dim, a.window_size
    for s in a.kv_source_layers:
        if max_seq_len % a.compress_ratios[s]:
            raise ValueError(f"max_seq_len {max_seq_len} must be a multiple of every compress ratio")
    rings = tuple(RingCache(jnp.zeros((batch, w, h), jnp.float8_e4m3fn), jnp.zeros((batch, w, h // 32), jnp.uint8))
                  for _ in range(cfg.n_layers))
    sources = []
    for s in a.kv_source_layers:
        m = a.compress_ratios[s]
        t = max_seq_len // m
        carry = h if m > 1 else 0
        sources.append(SourceCache(
            jnp.zeros((batch, t, h // 2), jnp.uint8), jnp.zeros((batch, t, h // 16), jnp.float8_e4m3fn),
            jnp.zeros((batch, t, i // 2), jnp.uint8), jnp.zeros((batch, t, i // 32), jnp.uint8),
            jnp.zeros((batch, carry), jnp.float32), jnp.zeros((batch, carry), jnp.float32)))
    return Cache(jnp.zeros((batch,), jnp.int32), rings, tuple(sources))


def source_index(cfg: ModelConfig, layer: int) -> int:
    return cfg.attention.kv_source_layers.index(layer)


# ----------------------------------------------------------------------------------------------------
# reads and writes (packing happens here; the model sees QDQ'd values, bit-identical to the fake quant)


def write_rows(buf: Array, rows: Array, index: Int[Array, "B S"]) -> Array:
    """buf [B, T, ...] with rows [B, S, ...] written at ``index`` (out-of-range index = not written)."""
    return fp4_reference.write_rows(buf, rows, index)


def gather_rows(buf: Array, index: Int[Array, "B S K"]) -> Array:
    """buf [B, T, ...] read at ``index`` [B, S, K] (−1 reads row 0; callers mask)."""
    return jax.vmap(lambda b, i: b[jnp.maximum(i, 0)])(buf, index)


# ``backend`` is the model's ``attention.kernel_backend``: the fp4_pack kernels are bit-exact to quant's
# pack/unpack, so the cache holds the same bytes and the model reads the same values either way.


def write_source(src: SourceCache, main_kv: Array, index_k: Array, index: Int[Array, "B S"], *,
                 backend: str = "xla") -> SourceCache:
    """Pack new main-KV and index-key rows [B, S, ...] into entry ``index`` (out of range = not written)."""
    kc, ks = fp4_pack.write_nvfp4(src.kv_codes, src.kv_scales, main_kv, index, backend=backend)
    ic, ie = fp4_pack.write_mxfp4(src.ik_codes, src.ik_exps, index_k, index, backend=backend)
    return src._replace(kv_codes=kc, kv_scales=ks, ik_codes=ic, ik_exps=ie)


def read_main_kv(src: SourceCache, index: Int[Array, "B S K"], dtype, *, backend: str = "xla") -> Array:
    """Dequantised main-KV entries [B, S, K, H] at ``index`` (only the picked rows are unpacked)."""
    return fp4_pack.unpack_nvfp4(gather_rows(src.kv_codes, index), gather_rows(src.kv_scales, index), dtype,
                                 backend=backend)


def read_index_keys_at(src: SourceCache, index: Int[Array, "B S K"], dtype, *, backend: str = "xla") -> Array:
    return fp4_pack.unpack_mxfp4(gather_rows(src.ik_codes, index), gather_rows(src.ik_exps, index), dtype,
                                 backend=backend)


def write_ring(ring: RingCache, kv: Array, pos: Int[Array, "B S"], write: Array) -> RingCache:
    """Write the rows flagged in ``write`` at slot ``pos mod W`` (callers flag at most W rows per sequence)."""
    w = ring.values.shape[1]
    v, e = quant.pack_fp8_ue8m0(kv)
    slot = jnp.where(write, pos % w, w)
    return RingCache(write_rows(ring.values, v, slot), write_rows(ring.exps, e, slot))


def read_ring(ring: RingCache, dtype) -> Array:
    return quant.unpack_fp8_ue8m0(ring.values, ring.exps, dtype)


def ring_positions(lengths: Int[ArrayLike, "B"], window: int) -> Int[Array, "B W"]:
    """Absolute position held by each ring slot before a chunk that starts at ``lengths`` (−1 = empty)."""
    last = lengths[:, None] - 1
    pos = last - jnp.mod(last - jnp.arange(window)[None, :], window)
    return jnp.where(pos >= 0, pos, -1)


# ----------------------------------------------------------------------------------------------------
# byte ledger (spec attention §7.5), from the cache arrays themselves


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def ledger(cfg: ModelConfig, max_seq_len: int = 8192) -> dict[str, float]:
    """Bytes per token of global KV, per-sequence SWA and carry bytes, computed with ``eval_shape``."""
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, max_seq_len))
    a = cfg.attention
    per_token = {}
    for layer, src in zip(a.kv_source_layers, cache.sources, strict=True):
        entry = sum(_nbytes(x) for x in src[:4]) / src.kv_codes.shape[1]
        per_token[layer] = entry / a.compress_ratios[layer]
    swa = sum(_nbytes(r.values) + _nbytes(r.exps) for r in cache.rings)
    carry = sum(_nbytes(s.carry_c) + _nbytes(s.carry_z) for s in cache.sources)
    specs = topology(cfg)
    return {"global_kv_bytes_per_token": sum(per_token.values()),
            **{f"global_kv_bytes_per_token_layer_{k}": v for k, v in per_token.items()},
            "swa_bytes_per_sequence": swa, "compressor_carry_bytes_per_sequence": carry,
            "encoder_swa_bytes_per_sequence": sum(_nbytes(r.values) + _nbytes(r.exps)
                                                  for r, s in zip(cache.rings, specs, strict=True)
                                                  if s.part == "encoder")}


# ----------------------------------------------------------------------------------------------------
# sharding: sequences over the data axis, like the activations; the shared compressed caches optionally
# sequence-sharded too (long contexts)


def cache_partition_specs(cache: Cache, mesh: jax.sharding.Mesh | None = None, *,
                          batch_axis: str | tuple[str, ...] = "data", sequence_axis: str | None = None):
    """A :class:`Cache`-shaped pytree of PartitionSpecs: batch over ``batch_axis`` (one mesh axis or several);
    the global (compressed) caches' entry axis over ``sequence_axis`` if given. An axis that does not divide
    is left replicated."""
    import math

    from jax.sharding import PartitionSpec as P

    def fits(axis, size):
        if axis is None or mesh is None:
            return axis is not None
        return size % math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)) == 0

    def spec(x, seq: bool):
        b = batch_axis if fits(batch_axis, x.shape[0]) else None
        if seq and x.ndim >= 2 and fits(sequence_axis, x.shape[1]):
            return P(b, sequence_axis, *([None] * (x.ndim - 2)))
        return P(b, *([None] * (x.ndim - 1)))

    return Cache(spec(cache.lengths, False),
                 tuple(RingCache(*(spec(x, False) for x in r)) for r in cache.rings),
                 tuple(SourceCache(*(spec(x, i < 4) for i, x in enumerate(s))) for s in cache.sources))


# ----------------------------------------------------------------------------------------------------
# the engine's KV store (dsv41_jax.model.kv_store): the packed cache under a chunk of new tokens


@pytree_dataclass
@dataclass(frozen=True)
class PackedKV:
    """:class:`~dsv41_jax.model.kv_store.KVStore` over the packed cache, for a chunk of new tokens per sequence.

    The chunk's ``n_new[b]`` tokens follow the ``lengths[b]`` the cache held before it. Compressed entries of
    groups that end in the chunk are packed at their entry (a ratio-2 group straddling chunks is completed from
    the carry); groups ending before ``write_floor`` are never rewritten (bounded replay, spec §9.4). The last
    ``window`` tokens of each sequence enter their layer's SWA ring. Reads unpack only what a layer reads.
    """

    lengths: Int[Array, "B"]  # tokens in the cache before the chunk
    n_new: Int[Array, "B"]
    write_floor: Int[Array, "B"]
    ring_pos: Int[Array, "B W"]  # position each ring slot holds before the chunk (−1 = empty), every layer's
    rings: tuple[RingCache, ...]  # by layer
    sources: dict[int, SourceCache]  # by KV-source layer
    backend: str = field(default="xla", metadata=dict(static=True))  # attention.kernel_backend
    # ratio-2 sources: the compressor's (c, z) of every row of the chunk [B, S, H], kept when asked for: the
    # carry after any prefix of the chunk (speculative decoding's rollback, dsv41_jax.engine.speculative)
    row_carries: dict[int, tuple[Array, Array]] | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, cache: Cache, n_new: Array, write_floor: Array | None = None, *,
           keep_row_carries: bool = False) -> PackedKV:
        floor = jnp.zeros_like(cache.lengths) if write_floor is None else write_floor
        sources = dict(zip(cfg.attention.kv_source_layers, cache.sources, strict=True))
        ring_pos = ring_positions(cache.lengths, cfg.attention.window_size)
        return cls(cache.lengths, n_new, floor, ring_pos, cache.rings, sources, cfg.attention.kernel_backend,
                   {} if keep_row_carries else None)

    def cache(self) -> Cache:
        """The cache after the chunk."""
        return Cache(self.lengths + self.n_new, self.rings, tuple(self.sources[k] for k in sorted(self.sources)))

    def compress(self, layer, compressor, x, vis):
        m, src = layer.ratio, self.sources[layer.layer]
        valid = vis.valid
        if m == 1:
            latent = compressor(x)  # [B, S, H]: one entry per token
            closes = valid
        else:
            c, z = compressor.project(x)  # fp32 [B, S, H]
            prev_c = jnp.concatenate([src.carry_c[:, None], c[:, :-1]], axis=1)
            prev_z = jnp.concatenate([src.carry_z[:, None], z[:, :-1]], axis=1)
            latent = compressor.pool(jnp.stack([prev_c, c], axis=2), jnp.stack([prev_z, z], axis=2), x.dtype)
            closes = valid & (vis.pos % m == m - 1)
            last = jnp.maximum(valid.sum(-1) - 1, 0)[:, None, None]
            keep = valid.any(-1)[:, None]  # the open group's first token becomes the carry
            src = src._replace(carry_c=jnp.where(keep, jnp.take_along_axis(c, last, 1)[:, 0], src.carry_c),
                               carry_z=jnp.where(keep, jnp.take_along_axis(z, last, 1)[:, 0], src.carry_z))
        entry = vis.pos // m
        # bounded replay never rewrites global KV; a group that ends at or after the floor is still written
        write = closes & (vis.pos >= self.write_floor[:, None])
        slots = Slots(entry * m, jnp.where(write, entry, src.kv_codes.shape[1]))
        store = self._with_source(layer.layer, src)
        if m > 1 and self.row_carries is not None:
            store = dataclasses.replace(store, row_carries={**self.row_carries, layer.layer: (c, z)})
        return latent, slots, store

    def write_entries(self, layer, main_kv, index_k, slots):
        src = write_source(self.sources[layer.layer], main_kv, index_k, slots.index, backend=self.backend)
        return self._with_source(layer.layer, src)

    def n_entries(self, layer):
        return self.sources[layer.kv_source].kv_codes.shape[1]

    def index_scores(self, layer, iq, w):
        src = self.sources[layer.kv_source]
        return index_scan.index_scores(iq, w, src.ik_codes, src.ik_exps, backend=self.backend)

    def index_keys_at(self, layer, index, dtype):
        return read_index_keys_at(self.sources[layer.kv_source], index, dtype, backend=self.backend)

    def main_kv(self, layer, dtype):
        src = self.sources[layer.kv_source]
        return fp4_pack.unpack_nvfp4(src.kv_codes, src.kv_scales, dtype, backend=self.backend)

    def attended_entries(self, layer, topk, dtype):
        return None, read_main_kv(self.sources[layer.kv_source], topk, dtype, backend=self.backend)

    def packed_attention(self, layer, q, window_kv, sink, topk, vis):
        """A decode step's attention read straight from the ring and the picked packed rows on GPU with
        ``kernel_backend: pallas`` (``sparse_attention.packed_decode``); None elsewhere."""
        if not sparse_api.packed_decode_applies(q, self.backend):
            return None
        ring = self.rings[layer.layer]
        codes = scales = None
        if layer.compressed:
            src = self.sources[layer.kv_source]
            codes, scales = src.kv_codes, src.kv_scales
        return sparse_api.sparse_decode(q, window_kv, sink, ring.values.shape[1], ring.values, ring.exps,
                                        self.ring_pos, codes, scales, topk, vis.start, vis.floor)

    def window(self, layer, dtype):
        return read_ring(self.rings[layer.layer], dtype), self.ring_pos

    def write_window(self, layer, window_kv, vis):
        w = self.rings[layer.layer].values.shape[1]
        last = self.lengths + self.n_new - 1
        write = vis.valid & (vis.pos > last[:, None] - w)  # each sequence's last W tokens
        rings = list(self.rings)
        rings[layer.layer] = write_ring(rings[layer.layer], window_kv, vis.pos, write)
        return dataclasses.replace(self, rings=tuple(rings))

    def _with_source(self, layer: int, src: SourceCache) -> PackedKV:
        return dataclasses.replace(self, sources={**self.sources, layer: src})
