"""Image prompts end to end: images through the compiled encoder, spans into the backbone's input embeddings.

:class:`ImageEncoder` compiles the vision tower once per image grid. :meth:`ImageEncoder.prompt_inputs` turns
prompts holding one ``image_token_id`` placeholder per image into what every forward takes: the expanded ids,
``token_types``, ``is_image`` and the span embeddings [B, S, D] (``Transformer.embed_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from dsv41_jax.vision.encoder import delimiters, encode
from dsv41_jax.vision.processor import ProcessedImage
from dsv41_jax.vision.spans import IMAGE_END, IMAGE_START, Span, expand_prompt, row_index, span_embeddings


class Encoded(NamedTuple):
    vit: Float[Array, "T E"]  # ViT output after its final norm, patches row-major
    rows: Float[Array, "L D"]  # aligner rows in reading order


class PromptInputs(NamedTuple):
    """A batch of image prompts, ready for the backbone (right-padded with ``pad_id`` / TEXT)."""

    ids: np.ndarray  # int64 [B, S]
    token_types: np.ndarray  # int64 [B, S]
    lengths: np.ndarray  # int64 [B]
    embeds: jax.Array  # [B, S, D] span embeddings (zeros at text positions)
    encoded: tuple[Encoded, ...]  # per image

    @property
    def is_image(self) -> np.ndarray:
        return self.token_types >= 0


def spans_of(token_types: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each image span of one sequence, in order; a span must close before the next opens."""
    starts = np.flatnonzero(token_types == IMAGE_START)
    ends = np.flatnonzero(token_types == IMAGE_END)
    if len(starts) != len(ends) or np.any(ends < starts) or np.any(starts[1:] < ends[:-1]):
        raise ValueError(f"token_types hold {len(starts)} IMAGE_START and {len(ends)} IMAGE_END in a broken order")
    return [(int(s), int(e - s + 1)) for s, e in zip(starts, ends, strict=True)]


class ImageEncoder:
    """The vision tower of a :class:`VisionEncoder` (or of a model trained with one, ``VisionLanguageModel``),
    compiled per image grid."""

    def __init__(self, encoder: nnx.Module):
        graphdef, self.state = nnx.split(encoder)
        self.cfg = encoder.vision.cfg
        self._encode = jax.jit(lambda st, p, n_h, n_w: encode(nnx.merge(graphdef, st), p, n_h, n_w),
                               static_argnums=(2, 3))
        self._embeds = jax.jit(lambda st, t, rows, idx: span_embeddings(t, rows, idx,
                                                                         *delimiters(nnx.merge(graphdef, st))))

    def encode(self, image: ProcessedImage) -> Encoded:
        vit, rows = self._encode(self.state, jnp.asarray(image.patches)[None], image.n_vit_h, image.n_vit_w)
        return Encoded(vit[0], rows[0])

    def span_embeds(self, token_types: np.ndarray, spans: Sequence[Sequence[Span]], encoded: Sequence[Encoded]
                    ) -> jax.Array:
        """[B, S, D]: each span position's embedding; ``spans[b]`` says which image fills each span of row b."""
        rows = jnp.concatenate([e.rows for e in encoded])
        index = row_index(token_types, spans, [e.rows.shape[0] for e in encoded])
        return self._embeds(self.state, jnp.asarray(token_types), rows, jnp.asarray(index))

    def prompt_inputs(self, prompts: Sequence[Sequence[int]], images: Sequence[ProcessedImage], image_token_id: int,
                      pad_id: int = 0, images_per_prompt: Sequence[Sequence[int]] | None = None) -> PromptInputs:
        """Prompts whose k-th ``image_token_id`` stands for image ``images_per_prompt[b][k]`` (default: the images
        in order across the batch), expanded and embedded."""
        if images_per_prompt is None:
            counts = [int(np.sum(np.asarray(p) == image_token_id)) for p in prompts]
            if sum(counts) != len(images):
                raise ValueError(f"the prompts hold {sum(counts)} image placeholder(s) but {len(images)} image(s) "
                                 "were given")
            first = np.cumsum([0, *counts])
            images_per_prompt = [list(range(first[b], first[b + 1])) for b in range(len(prompts))]
        grids = [(im.n_llm_h, im.n_llm_w) for im in images]
        expanded = []
        for b, (p, which) in enumerate(zip(prompts, images_per_prompt, strict=True)):
            try:
                expanded.append(expand_prompt(p, grids, image_token_id, which))
            except ValueError as err:
                raise ValueError(f"prompt {b}: {err}") from None
        lengths = np.array([len(e.ids) for e in expanded], np.int64)
        s = int(lengths.max())
        ids = np.full((len(prompts), s), pad_id, np.int64)
        types = np.full((len(prompts), s), -1, np.int64)
        for b, e in enumerate(expanded):
            ids[b, : len(e.ids)], types[b, : len(e.ids)] = e.ids, e.token_types
        encoded = tuple(self.encode(im) for im in images)
        embeds = self.span_embeds(types, [e.spans for e in expanded], encoded)
        return PromptInputs(ids, types, lengths, embeds, encoded)
