"""The backbone with its vision tower: what image–text training differentiates through.

:class:`VisionLanguageModel` is the :class:`~dsv41_jax.model.transformer.Transformer` plus ``vision``,
``aligner`` and ``image_start`` / ``image_end`` / ``image_newline``, every name as in the release checkpoint,
so the train state, its checkpoints and the optimizer's name rules see one tree. Its forward on a packed
batch encodes the row's images, writes the span embeddings and runs the one backbone forward.
"""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float, Int

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.vision.encoder import add_tower, delimiters, encode
from dsv41_jax.vision.spans import span_embeddings


class VisionLanguageModel(Transformer):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        add_tower(self, cfg.vision, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)

    def image_embeds(self, patches: Float[Array, "B M T C P Q"], token_types: Int[Array, "B S"],
                     image_slot: Int[Array, "B S"]) -> Float[Array, "B S D"]:
        """Span embeddings of packed rows: row b's ``M`` images (one grid) encoded, IMAGE position s taking
        aligner row ``image_slot[b, s]`` of them, the delimiters their vectors."""
        b, m, t = patches.shape[:3]
        side = int(round(t ** 0.5))  # training images are square (vision.config)
        _, rows = encode(self, patches.reshape(b * m, *patches.shape[2:]), side, side)  # [B·M, L, D]
        rows = rows.reshape(b, -1, rows.shape[-1])  # [B, M·L, D]
        start, end, newline = delimiters(self)
        return jax.vmap(lambda ty, r, i: span_embeddings(ty[None], r, i[None], start, end, newline)[0])(
            token_types, rows, image_slot)
