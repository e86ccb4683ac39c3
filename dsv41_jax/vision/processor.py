"""The image processor: an image becomes ViT patches and an LLM token grid (spec model §7.3).

The resize plan is pure integer/float arithmetic on the image size (:func:`plan_image_grid`): upscale to at
least ``min_pixels`` keeping the aspect ratio, round both sides up to a multiple of the patch size, and when
the span would exceed ``max_n_token`` positions solve for the largest aspect-preserving size that fits (with
its two degenerate cases for extremely tall or wide images). The pixels are letterboxed into that size by
Pillow's ``ImageOps.pad`` (bicubic, centred, grey 127 fill): Pillow's resampling is what the reference runs,
so the resized pixels, and hence the patches, are bit-identical to it. Values are scaled to [-1, 1],
rounded to bf16 and cut into ``patch_size`` squares in row-major order, (channel, row, column) inside.
"""

from __future__ import annotations

import base64
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv41_jax.config import VisionConfig

PAD_COLOUR = (127, 127, 127)  # letterbox fill (spec model §7.3)


@dataclass(frozen=True)
class GridPlan:
    """Where an image of a given size goes: pixels after resizing, the ViT patch grid and the LLM grid."""

    n_llm_h: int
    n_llm_w: int
    height: int  # pixels after resizing
    width: int

    def vit_grid(self, patch_size: int) -> tuple[int, int]:
        return self.height // patch_size, self.width // patch_size

    @property
    def span_len(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


@dataclass(frozen=True)
class ProcessedImage:
    """What the ViT and the span layout need from one image."""

    patches: np.ndarray  # bfloat16 [n_vit_h·n_vit_w, 3, p, p], row-major patches
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def span_len(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """IMAGE_START, n_llm_h rows of (n_llm_w IMAGE + IMAGE_NEW_LINE), IMAGE_END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(height: int, width: int, patch_size: int, downsample: int) -> tuple[int, int]:
    """The aligner's token grid for an image of ``height`` × ``width`` pixels (ceil of the patch grid / 3)."""
    return math.ceil((height // patch_size) / downsample), math.ceil((width // patch_size) / downsample)


def _fit_to_budget(height: float, width: float, patch_size: int, downsample: int, max_n_token: int
                   ) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose span holds at most ``max_n_token`` positions."""
    r = height / width
    max_w = math.sqrt((max_n_token - 2) / r + 0.25) - 0.5  # n_w·(n_w·r + 1) + 2 = max_n_token, solved for n_w
    max_h = max_w * r
    cell = patch_size * downsample
    if max_w < 1.0:  # very tall: one column
        return (max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one row
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / patch_size) * patch_size, math.floor(width * beta / patch_size) * patch_size


def plan_image_grid(width: int, height: int, cfg: VisionConfig) -> GridPlan:
    """The resize plan of an image of ``width`` × ``height`` pixels (the reference's ``plan_image_grid``)."""
    p = cfg.patch_size
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = height * cfg.max_wh_ratio
    if 0 < width * height < cfg.min_pixels:
        ratio = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * ratio), int(height * ratio)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_h, n_w = llm_grid(best_h, best_w, p, cfg.downsample_ratio)
    if span_length(n_h, n_w) > cfg.max_n_token:
        best_h, best_w = _fit_to_budget(height, width, p, cfg.downsample_ratio, cfg.max_n_token)
        n_h, n_w = llm_grid(best_h, best_w, p, cfg.downsample_ratio)
    return GridPlan(n_h, n_w, int(best_h), int(best_w))


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImportError("images need Pillow (the resize must be Pillow's own to match the reference): "
                          "pip install 'dsv41-jax[vision]'") from None
    return Image, ImageOps


def image_bytes(source: str | os.PathLike | bytes) -> bytes:
    """The encoded bytes of an image given as bytes, a file path or a ``data:`` URL (base64)."""
    if isinstance(source, bytes):
        return source
    text = str(source)
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header:
            raise ValueError(f"image data URL {header[:60]!r}: only base64 data URLs are supported")
        return base64.b64decode(payload)
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"image {text}: no such file")
    return path.read_bytes()


def decode_rgb(source: str | os.PathLike | bytes | np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] RGB pixels of an image (PNG, JPEG, ... via Pillow), or of an RGB array as it is."""
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3 or 0 in source.shape:
            raise ValueError(f"an image array must be uint8 [H, W, 3] RGB, got {source.dtype} {source.shape}")
        return source
    image, _ = _pil()
    data = image_bytes(source)
    try:
        with image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as err:  # Pillow's UnidentifiedImageError, truncated files, ...
        name = "image bytes" if isinstance(source, bytes) else f"image {str(source)[:80]}"
        raise ValueError(f"{name}: cannot decode ({err})") from None


def resize(rgb: np.ndarray, plan: GridPlan, cfg: VisionConfig) -> np.ndarray:
    """uint8 [plan.height, plan.width, 3]: letterboxed (``ImageOps.pad``), or stretched when the image is
    wider than ``max_wh_ratio`` (the reference's two branches)."""
    image, ops = _pil()
    im = image.fromarray(rgb, "RGB")
    size = (plan.width, plan.height)
    h, w = rgb.shape[:2]
    if cfg.max_wh_ratio is not None and w >= cfg.max_wh_ratio * h:
        return np.asarray(im.resize(size))
    return np.asarray(ops.pad(im, size, color=PAD_COLOUR))


def to_patches(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """bfloat16 [n_h·n_w, 3, p, p] from uint8 [H, W, 3]: (x/255 − 0.5)/0.5 in fp32, then rounded to bf16."""
    h, w, _ = pixels.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"pixels {h}x{w} are not a whole number of {p}x{p} patches")
    x = (pixels.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    x = x.astype(ml_dtypes.bfloat16)
    return x.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, p, p)


def process_image(source: str | os.PathLike | bytes | np.ndarray, cfg: VisionConfig) -> ProcessedImage:
    """One image (bytes, path, data URL or uint8 RGB array) through the whole processor."""
    rgb = decode_rgb(source)
    plan = plan_image_grid(rgb.shape[1], rgb.shape[0], cfg)
    n_h, n_w = plan.vit_grid(cfg.patch_size)
    return ProcessedImage(to_patches(resize(rgb, plan, cfg), cfg.patch_size), n_h, n_w, plan.n_llm_h, plan.n_llm_w)
