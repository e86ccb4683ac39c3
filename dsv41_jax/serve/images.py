"""Images in chat requests: OpenAI ``image_url`` content parts become image spans, as ``dsv41 sample --image``.

A part's URL is a ``data:image/...;base64,...`` URL, or a local file (a path or a ``file://`` URL) inside the
directory the server was started with (``--allowed-local-media-path``, as vLLM names it; without it local files
are refused: a remote client must not make the server read its files). Remote ``http(s)://`` URLs are refused:
fetching them would let a client make the server open connections anywhere its network reaches.

Each image goes through the checkpoint's processor and vision tower (:class:`~dsv41_jax.vision.prompt.
ImageEncoder`), and its placeholder token becomes its span. The prefix cache keys a prompt by
:func:`cache_keys`: the token ids, with every position of an image's span replaced by a key derived from the
SHA-256 of that image's pixels as the model sees them, so two different images behind the same placeholder ids
never share a cached prefix.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import jax
import numpy as np

from dsv41_jax.config import VisionConfig
from dsv41_jax.vision.processor import ProcessedImage, image_bytes, process_image
from dsv41_jax.vision.prompt import ImageEncoder, spans_of


class ImageError(ValueError):
    """An image part that cannot be used; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images expanded: what the scheduler feeds and how the prefix cache keys it."""

    ids: list[int]  # the expanded ids (every span position holds the image token)
    token_types: np.ndarray  # int64 [S]
    embeds: jax.Array  # [S, D] span embeddings (zeros at text positions)
    keys: np.ndarray  # int64 [S]: cache_keys


def image_key(digest: bytes) -> int:
    """A negative int64 standing for one image at each position of its span (token ids are never negative)."""
    return -1 - (int.from_bytes(digest[:8], "little") >> 1)


def pixel_digest(image: ProcessedImage) -> bytes:
    """SHA-256 of what the vision tower sees: the patch grid and the patches' bytes."""
    h = hashlib.sha256(np.array([image.n_vit_h, image.n_vit_w, image.n_llm_h, image.n_llm_w], np.int64).tobytes())
    h.update(np.ascontiguousarray(image.patches).tobytes())
    return h.digest()


def cache_keys(ids: Sequence[int], token_types: np.ndarray, digests: Sequence[bytes]) -> np.ndarray:
    """int64 [S]: ``ids`` with the k-th span's positions all set to :func:`image_key` of ``digests[k]``."""
    keys = np.asarray(ids, np.int64).copy()
    spans = spans_of(np.asarray(token_types))
    if len(spans) != len(digests):
        raise ValueError(f"{len(spans)} image span(s) but {len(digests)} image digest(s)")
    for (start, length), digest in zip(spans, digests, strict=True):
        keys[start: start + length] = image_key(digest)
    return keys


class ImageInputs:
    """The server's vision path: URL -> pixels -> span embeddings, one request at a time."""

    def __init__(self, encoder: ImageEncoder, cfg: VisionConfig, image_token_id: int, pad_id: int,
                 local_dir: str | os.PathLike | None = None):
        self.encoder, self.cfg, self.image_token_id, self.pad_id = encoder, cfg, image_token_id, pad_id
        self.local_dir = Path(local_dir).resolve() if local_dir else None
        self._lock = threading.Lock()  # one image prompt through the tower at a time (its programs compile once)

    def source(self, url: str, param: str) -> bytes:
        """The encoded bytes behind an image URL, or an :class:`ImageError` naming ``param``."""
        scheme = urlparse(url).scheme.lower()
        if url.startswith("data:"):
            if not url[5:].lower().startswith("image/"):
                raise ImageError(f"a data URL must hold an image (data:image/...;base64,...), got {url[:40]!r}", param)
            try:
                return image_bytes(url)
            except ValueError as err:  # not base64, or bad padding
                raise ImageError(str(err), param) from None
        if scheme in ("http", "https", "ftp"):
            raise ImageError("remote image URLs are not fetched: send the image inline as a data:image/...;base64 "
                             "URL", param)
        if scheme not in ("", "file"):
            raise ImageError(f"unsupported image URL scheme {scheme!r}: use a data: URL or a local file", param)
        if self.local_dir is None:
            raise ImageError("local image files are refused: this server was started without "
                             "--allowed-local-media-path (send a data:image/...;base64 URL instead)", param)
        path = (self.local_dir / (unquote(urlparse(url).path) if scheme == "file" else url)).resolve()
        if not path.is_relative_to(self.local_dir):
            raise ImageError(f"{path} lies outside the allowed local media path {self.local_dir}", param)
        if not path.is_file():
            raise ImageError(f"no such image file: {path}", param)
        return path.read_bytes()

    def prompt(self, ids: list[int], images: Sequence[tuple[str, str]]) -> ImagePrompt:
        """``ids`` (one image token per image) with each ``(param, url)`` image expanded into its span."""
        processed = []
        for param, url in images:
            data = self.source(url, param)
            try:
                processed.append(process_image(data, self.cfg))
            except ValueError as err:
                raise ImageError(str(err), param) from None
        with self._lock:
            try:
                inputs = self.encoder.prompt_inputs([ids], processed, self.image_token_id, pad_id=self.pad_id)
            except ValueError as err:  # placeholders and images do not match (the text spells the token)
                raise ImageError(str(err), "messages") from None
        n = int(inputs.lengths[0])
        types = inputs.token_types[0, :n]
        expanded = [int(t) for t in inputs.ids[0, :n]]
        return ImagePrompt(expanded, types, inputs.embeds[0, :n],
                           cache_keys(expanded, types, [pixel_digest(im) for im in processed]))
