"""Where an attention layer's keys live: the visibility rule and the KV-store protocol (spec attention §3, §8, §9).

:class:`~dsv41_jax.model.attention.Attention` is written once. It computes its query, its own SWA entries
and (in KV-source layers) compressed entries and index keys, hands them to a *store* and asks the store for
the keys to attend to. Two stores implement :class:`KVStore`:

* :class:`DenseKV` (here): a full-sequence forward (training, scoring, the post-training served path).
  Entries are fake-quantised tensors in memory; every window key is in the forward's own rows.
* :class:`~dsv41_jax.cache.PackedKV`: the engine's packed cache (E2M1 + E4M3 main KV, MXFP4 index keys,
  FP8 SWA rings, the ratio-2 compressor carry) under a chunk of new tokens.

What a query may see is :class:`Visibility`: its position, the floor below which no window key is visible
(bounded replay, CED's truncated windows) and the documents of a packed training row. Those are arguments,
not forks of the layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.model.compressor import Compressor
from dsv41_jax.model.documents import Documents, Entries, entries
from dsv41_jax.model.indexer import index_scores
from dsv41_jax.topology import LayerSpec


class Visibility(NamedTuple):
    """Which keys the rows of a forward may see.

    Rows are consecutive positions of one sequence each (``pos[:, 0] + i``), unless ``docs`` packs several
    documents into a row; then ``pos`` restarts at 0 in each document and nothing crosses a boundary.
    """

    pos: Int[Array, "B S"]  # RoPE position of every row (in its document, with docs)
    floor: Int[Array, "B"] | int = 0  # no window key below this position (bounded replay, CED truncation)
    docs: Documents | None = None  # packed documents (training rows); excludes a floor
    valid: Bool[Array, "B S"] | None = None  # real tokens of a ragged chunk (None: every row)

    @property
    def start(self) -> Int[Array, "B"] | None:
        """Position of row 0, where rows are consecutive positions (None with documents)."""
        return None if self.docs is not None else self.pos[:, 0]

    @property
    def key_floor(self) -> Int[Array, "B S"] | None:
        """Per row, the lowest row its window may reach: its document's first row (documents only)."""
        return None if self.docs is None else self.docs.start

    def entries(self, ratio: int) -> Entries:
        """Compressed entries of ratio ``ratio`` each row may see: ``lo ≤ t < hi`` (spec §3.5)."""
        b, s = self.pos.shape
        if self.docs is not None:
            return entries(self.docs, ratio, b, s)
        return Entries(None, None, None, (self.pos + 1) // ratio)

    def with_floor(self, floor) -> Visibility:
        if self.docs is not None:
            raise ValueError("a window floor (bounded replay, CED) is per sequence: packed documents (segment_ids) "
                             "have their own windows; give unpacked rows")
        return self._replace(floor=jnp.broadcast_to(jnp.asarray(floor, jnp.int32), self.pos.shape[:1]))


class Slots(NamedTuple):
    """Where the compressed entries a chunk produces go."""

    positions: Int[Array, "B C"]  # RoPE position of each entry: its group's first token (§3.4)
    index: Int[Array, "B C"] | None  # entry each is written to (out of range: not written); None: all, in order


class KVStore(Protocol):
    """What one attention layer asks of the keys it does not compute itself (``layer`` = its LayerSpec)."""

    def compress(self, layer: LayerSpec, compressor: Compressor, x: Float[Array, "B S D"], vis: Visibility
                 ) -> tuple[Float[Array, "B C H"], Slots, KVStore]:
        """Pre-RoPE latents of the groups this forward completes, and where they go (§3.3)."""

    def write_entries(self, layer: LayerSpec, main_kv: Float[Array, "B C H"], index_k: Float[Array, "B C I"],
                      slots: Slots) -> KVStore:
        """Store a KV source's post-RoPE main KV and its index keys, in the store's formats (§7.2, §7.3)."""

    def n_entries(self, layer: LayerSpec) -> int:
        """How many entries the layer's KV source holds (visible or not)."""

    def index_scores(self, layer: LayerSpec, iq: Float[Array, "B S N I"], w: Float[Array, "B S N"]
                     ) -> Float[Array, "B S T"]:
        """Every entry's index score ``Σ_h w_h·ReLU(q_h·k_t)`` under the layer's KV source (fp32, unmasked)."""

    def index_keys_at(self, layer: LayerSpec, index: Int[Array, "B S K"], dtype) -> Float[Array, "B S K I"]:
        """Index keys at ``index`` (callers mask negative ones)."""

    def main_kv(self, layer: LayerSpec, dtype) -> Float[Array, "B T H"]:
        """Every main-KV entry of the layer's KV source."""

    def attended_entries(self, layer: LayerSpec, topk: Int[Array, "B S K"], dtype
                         ) -> tuple[Float[Array, "B T H"] | None, Float[Array, "B S K H"] | None]:
        """``(compressed_kv, picked)`` for :func:`~dsv41_jax.model.sparse.sparse_attention`: one is None."""

    def packed_attention(self, layer: LayerSpec, q: Float[Array, "B S N H"], window_kv: Float[Array, "B S H"],
                         sink: Float[Array, "N"], topk: Int[Array, "B S K"] | None, vis: Visibility
                         ) -> Float[Array, "B S N H"] | None:
        """The attention core computed from the store's own formats by a kernel, or None where the model's
        core (:func:`~pallas_kernels.sparse_attention.api.sparse_attention`) runs on the store's keys."""

    def window(self, layer: LayerSpec, dtype) -> tuple[Float[Array, "B W H"] | None, Int[Array, "B W"] | None]:
        """Window keys from before this forward and their positions (−1 = empty), or ``(None, None)``."""

    def write_window(self, layer: LayerSpec, window_kv: Float[Array, "B S H"], vis: Visibility) -> KVStore:
        """Keep this forward's SWA entries for later forwards (a no-op where nothing comes later)."""


class PrefixReuse(NamedTuple):
    """Global KV of every KV source from the prefix cache, and each row's hit length (spec §9.4)."""

    main_kv: dict[int, Float[Array, "B C H"]]  # by KV-source layer
    index_k: dict[int, Float[Array, "B C I"]]
    hit: Int[Array, "B"]


def pytree_dataclass(cls):
    """Register a frozen dataclass as a pytree (fields with ``metadata=dict(static=True)`` are static), as
    ``jax.tree_util.register_dataclass`` does, except that rebuilding it from leaves does not call ``__init__``.

    JAX rebuilds pytrees with leaves that are not arrays (``ShapeDtypeStruct`` under ``eval_shape``, ``None`` or
    sentinels in tree utilities): through ``__init__`` those would meet the fields' jaxtyping annotations when
    they are checked at run time. Objects the code constructs itself are still checked.
    """
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    meta = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten_with_keys(x):
        return [(jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in data], tuple(getattr(x, n) for n in meta)

    def flatten(x):
        return [getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in (*zip(data, children, strict=True), *zip(meta, aux, strict=True)):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


@pytree_dataclass
@dataclass(frozen=True)
class DenseKV:
    """The store of a full-sequence forward: the latest KV source's entries as (fake-quantised) tensors.

    ``qdq_main`` fake-quantises main KV to NVFP4 (``cache_quant.main_kv``; index keys arrive quantised from
    the indexer). With ``reuse`` (the post-training served path), entries whose group ends before a row's
    hit come from the prefix cache instead: the engine's replay never rewrites them; a group straddling the
    hit is written from this forward's rows.
    """

    main: Float[Array, "B C H"] | None = None
    index: Float[Array, "B C I"] | None = None
    reuse: PrefixReuse | None = None
    qdq_main: bool = field(default=True, metadata=dict(static=True))

    def compress(self, layer, compressor, x, vis):
        ent = vis.entries(layer.ratio)
        first = ent.first
        c = x.shape[1] // layer.ratio
        positions = ent.positions
        if positions is None:  # one sequence from position 0: entry j starts at row j·m
            positions = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32) * layer.ratio, (x.shape[0], c))
        return compressor(x, first), Slots(positions, None), self

    def write_entries(self, layer, main_kv, index_k, slots):
        main_kv = quant.qdq_nvfp4(main_kv) if self.qdq_main else main_kv
        if self.reuse is not None and layer.layer in self.reuse.main_kv:
            kept = ((jnp.arange(main_kv.shape[1]) + 1) * layer.ratio <= self.reuse.hit[:, None])[..., None]
            main_kv = jnp.where(kept, self.reuse.main_kv[layer.layer], main_kv)
            index_k = jnp.where(kept, self.reuse.index_k[layer.layer], index_k)
        return DenseKV(main_kv, index_k, self.reuse, self.qdq_main)

    def n_entries(self, layer):
        return self.index.shape[1]

    def index_scores(self, layer, iq, w):
        return index_scores(iq, w, self.index)

    def index_keys_at(self, layer, index, dtype):
        return jax.vmap(lambda k, i: k[jnp.maximum(i, 0)])(self.index, index)

    def main_kv(self, layer, dtype):
        return self.main

    def attended_entries(self, layer, topk, dtype):
        return self.main, None

    def packed_attention(self, layer, q, window_kv, sink, topk, vis):
        return None

    def window(self, layer, dtype):
        return None, None

    def write_window(self, layer, window_kv, vis):
        return self
