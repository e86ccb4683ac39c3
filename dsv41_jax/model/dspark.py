"""DSpark, the speculative-decoding drafter of checkpoint namespace ``mtp.*`` (spec model §8).

Three stages, each a V4.1 :class:`~dsv41_jax.model.transformer.Block` of window-only attention with its own
MoE and mHC, draft ``block_size`` tokens in one forward from the target's features at the anchor's position.
Stage 0 owns ``main_proj`` / ``main_norm`` (the target features of layers ``dspark.target_layer_ids``, mean
over the streams, concatenated); the last stage owns ``norm``, the rank-r Markov head and the confidence head.
The embedding and the LM head are the target's.

Each stage keeps a ``window``-slot FP8 ring of the keys of the target positions it has been shown
(:meth:`DSpark.observe`: that stage's own ``wkv`` / ``kv_norm`` / RoPE over ``main_x``, FP8 fake-quantised,
exactly :meth:`Attention.window_kv`). A draft (:meth:`DSpark.propose`) feeds ``[anchor, noise × (K−1)]`` at
the positions after the last observed one; every slot attends to the ring and to all slots of its block
(``causal=False`` in the one sparse attention core). The Markov head then runs sequentially over the slots:
``logits_i = base_i + markov.embed[y_i] · markov.headᵀ`` with ``y_0`` the anchor, and the confidence head
reads the un-normalised collapsed hidden beside the same Markov embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import cache as C
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.attention import Shared
from dsv41_jax.model.kv_store import Visibility, pytree_dataclass
from dsv41_jax.model.layers import Linear, RMSNorm, fp32_head, normal
from dsv41_jax.model.mhc import collapse
from dsv41_jax.model.transformer import Block, Transformer
from dsv41_jax.sharding import param
from dsv41_jax.topology import layer_spec


class DraftCache(NamedTuple):
    """The drafter's rings: slot j of stage s holds the key of the newest observed target position ≡ j (mod W)."""

    lengths: Int[Array, "B"]  # target positions observed (the next is position ``lengths``)
    rings: tuple[C.RingCache, ...]  # one per stage


class Draft(NamedTuple):
    ids: Int[Array, "B K1"]  # [anchor, y_1 .. y_K]
    logits: Float[Array, "B K V"]  # fp32, base head plus Markov bias (the draft distribution's logits)
    confidence: Float[Array, "B K"]  # raw logits of each slot's conditional acceptance


def init_draft_cache(cfg: ModelConfig, batch: int) -> DraftCache:
    h, w = cfg.attention.head_dim, cfg.attention.window_size
    rings = tuple(C.RingCache(jnp.zeros((batch, w, h), jnp.float8_e4m3fn), jnp.zeros((batch, w, h // 32), jnp.uint8))
                  for _ in range(cfg.dspark.n_layers))
    return DraftCache(jnp.zeros((batch,), jnp.int32), rings)


@pytree_dataclass
@dataclass(frozen=True)
class DraftKV:
    """:class:`~dsv41_jax.model.kv_store.KVStore` of a draft block: each stage's keys of the target positions
    before the block (its ring, or in training the window gathered before an anchor) are its window prefix; the
    block's own keys are never kept."""

    keys: tuple[Float[Array, "B W H"], ...]  # one per stage
    pos: Int[Array, "B W"]  # position of each key (−1 = none)
    first_stage_layer: int = field(metadata=dict(static=True))

    def window(self, layer, dtype):
        return self.keys[layer.layer - self.first_stage_layer].astype(dtype), self.pos

    def write_window(self, layer, window_kv, vis):
        return self


class MarkovHead(nnx.Module):
    def __init__(self, vocab: int, rank: int, *, param_dtype, rngs: nnx.Rngs):
        self.embed = _Weight(param("markov", normal(rngs, (vocab, rank), 1.0, param_dtype)))
        self.head = _Weight(param("markov", normal(rngs, (vocab, rank), rank ** -0.5, param_dtype)))


class ConfidenceHead(nnx.Module):
    def __init__(self, width: int, *, param_dtype, rngs: nnx.Rngs):
        self.proj = _Weight(param("confidence", normal(rngs, (1, width), width ** -0.5, param_dtype)))


class _Weight(nnx.Module):
    """A bare ``weight`` under a module name, as the checkpoint spells it (``markov_head.embed.weight``)."""

    def __init__(self, weight: nnx.Param):
        self.weight = weight


class DraftStage(Block):
    """``mtp.{stage}``: a window-only V4.1 block, plus the input projection (first) or the heads (last)."""

    def __init__(self, cfg: ModelConfig, stage: int, *, rngs: nnx.Rngs):
        d = cfg.dspark
        super().__init__(cfg, layer_spec(cfg, cfg.n_layers + stage), n_experts=d.n_routed_experts,
                         k=d.n_activated_experts, rngs=rngs)
        pdt = jnp.dtype(cfg.param_dtype)
        if stage == 0:
            self.main_proj = Linear(len(d.target_layer_ids) * cfg.dim, cfg.dim, "main_proj", dtype=jnp.dtype(cfg.dtype),
                                    param_dtype=pdt, rngs=rngs, native=cfg.weight_format == "native")
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=pdt)
        if stage == d.n_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=pdt)
            self.markov_head = MarkovHead(cfg.vocab_size, d.markov_rank, param_dtype=pdt, rngs=rngs)
            self.confidence_head = ConfidenceHead(cfg.dim + d.markov_rank, param_dtype=pdt, rngs=rngs)


class DSpark(nnx.Module):
    """The drafter (``mtp.0 .. mtp.{n−1}``); the target's embedding and head are passed to :meth:`propose`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.dspark.n_layers < 1:
            raise ValueError("this config has no DSpark stages (dspark.n_layers = 0)")
        self.mtp = nnx.List([DraftStage(cfg, s, rngs=rngs) for s in range(cfg.dspark.n_layers)])
        self.cfg = cfg

    def main_x(self, main_hidden: Float[Array, "B R F"]) -> Float[Array, "B R D"]:
        """``main_norm(main_proj(main_hidden))``: the target features every stage's ring keys come from."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(main_hidden.astype(self.cfg.dtype)))

    def observe(self, cache: DraftCache, main_hidden: Float[Array, "B R F"], pos: Int[Array, "B R"],
                valid: Bool[Array, "B R"]) -> DraftCache:
        """Show the drafter the target features of the ``valid`` rows (positions ``pos``, ascending per row and
        continuing each sequence's ``lengths``): every stage writes its ring keys of each sequence's last W."""
        main_x = self.main_x(main_hidden)
        w = self.cfg.attention.window_size
        last = jnp.max(jnp.where(valid, pos, -1), axis=-1)  # [B]
        write = valid & (pos > last[:, None] - w)
        rings = tuple(C.write_ring(ring, stage.attn.window_kv(main_x, pos), pos, write)
                      for ring, stage in zip(cache.rings, self.mtp, strict=True))
        return DraftCache(jnp.where(last >= 0, last + 1, cache.lengths), rings)

    def propose(self, target: Transformer, cache: DraftCache, anchor: Int[Array, "B"], *, temperature: float = 0.0,
                keys: Array | None = None) -> Draft:
        """Draft ``block_size`` tokens after each ``anchor`` (the token at position ``cache.lengths``).

        ``temperature`` 0 takes the argmax of each slot's logits; otherwise ``keys`` (one PRNG key per
        sequence) sample each slot from ``softmax(logits / temperature)``, the draft distribution q.
        """
        dt = jnp.dtype(self.cfg.dtype)
        keys_before = tuple(C.read_ring(ring, dt) for ring in cache.rings)
        h, base = self.block(target, anchor, cache.lengths, keys_before,
                             C.ring_positions(cache.lengths, self.cfg.attention.window_size))
        ys, logits, conf = [anchor.astype(jnp.int32)], [], []
        for i in range(self.cfg.dspark.block_size):  # the Markov chain: each slot's bias from the token before it
            li, ci = self.heads(base[:, i], h[:, i], ys[-1])
            if temperature == 0:
                y = jnp.argmax(li, axis=-1).astype(jnp.int32)
            else:
                sub = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
                y = jax.vmap(jax.random.categorical)(sub, li / temperature).astype(jnp.int32)
            ys.append(y)
            logits.append(li)
            conf.append(ci)
        return Draft(jnp.stack(ys, 1), jnp.stack(logits, 1), jnp.stack(conf, 1))

    def block(self, target: Transformer, anchor: Int[Array, "B"], start: Int[Array, "B"],
              keys_before: tuple[Float[Array, "B W H"], ...], pos_before: Int[Array, "B W"]
              ) -> tuple[Float[Array, "B K D"], Float[Array, "B K V"]]:
        """The draft block ``[anchor, noise × (K−1)]`` at positions ``start + i`` through every stage, each seeing
        its ``keys_before`` (at ``pos_before``, −1 = none) and the whole block. Returns the collapsed hidden
        before the last stage's norm [B, K, D] and the base logits through the target's head [B, K, V] (fp32)."""
        cfg, d = self.cfg, self.cfg.dspark
        b, k = anchor.shape[0], d.block_size
        tokens = jnp.concatenate([anchor[:, None], jnp.full((b, k - 1), d.noise_token_id, anchor.dtype)], axis=1)
        x, pre = target.streams(target.embed_tokens(tokens))
        shared = Shared(DraftKV(keys_before, pos_before, cfg.n_layers))
        vis = Visibility(start[:, None] + jnp.arange(k)[None])
        for stage in self.mtp:
            x, pre, shared, _ = stage(x, pre, shared, None, vis)
        h = collapse(x, pre)
        base = fp32_head(self.mtp[-1].norm(h), target.head.weight[...])
        return h, base

    def heads(self, base: Float[Array, "*B V"], h: Float[Array, "*B D"], prev: Int[Array, "*B"]
              ) -> tuple[Float[Array, "*B V"], Float[Array, "*B"]]:
        """A slot's logits (base plus the Markov bias of the token before it) and raw confidence logit."""
        last = self.mtp[-1]
        e = jnp.take(last.markov_head.embed.weight[...], prev, axis=0).astype(jnp.float32)  # [*B, r]
        logits = base + jnp.einsum("...r,vr->...v", e, last.markov_head.head.weight[...].astype(jnp.float32),
                                   precision="highest")
        conf = jnp.einsum("...x,x->...", jnp.concatenate([h.astype(jnp.float32), e], axis=-1),
                          last.confidence_head.proj.weight[...][0].astype(jnp.float32), precision="highest")
        return logits, conf


def abstract_drafter(cfg: ModelConfig) -> DSpark:
    """``DSpark(cfg)`` with ``ShapeDtypeStruct`` leaves (shapes and dtypes, no memory)."""
    return nnx.eval_shape(lambda: DSpark(cfg, rngs=nnx.Rngs(0)))

