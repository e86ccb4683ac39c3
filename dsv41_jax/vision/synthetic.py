"""Synthetic image–caption pairs drawn on the fly: the embedded default of vision training (no download).

Example ``i`` of a seed is a deterministic function of ``(seed, i)``: one shape (square, circle, triangle,
cross) in one colour (red, green, blue, yellow) in one quadrant-like place (left, right, top, bottom) of a
noisy grey background, and a short word (GO, UP, HI, ME) written in light letters in the middle of the
opposite half, captioned ``"a red circle on the left and the word UP"``. The word is rendered with Pillow's
built-in font (:func:`PIL.ImageFont.load_default`, nothing to download) and scaled to fill the middle of its
half (:func:`word_ink`), so a model has to read it. Every attribute is uniform, so a model that does not look
at the image names each one with probability 1/4 (:data:`ATTRIBUTES`).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = ("left", "right", "top", "bottom")
WORDS = ("GO", "UP", "HI", "ME")  # no letter in common
ATTRIBUTES = {"colour": tuple(COLOURS), "shape": SHAPES, "place": PLACES, "word": WORDS}
OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


class Example(NamedTuple):
    rgb: np.ndarray  # uint8 [H, W, 3]
    caption: str
    attributes: dict[str, str]


def caption(colour: str, shape: str, place: str, word: str) -> str:
    return f"a {colour} {shape} on the {place} and the word {word}"


def _mask(shape: str, size: int) -> np.ndarray:
    """bool [size, size]: the shape, filling most of its box."""
    y, x = np.mgrid[0:size, 0:size] / (size - 1) * 2 - 1  # [-1, 1]²
    if shape == "square":
        return np.maximum(np.abs(x), np.abs(y)) <= 0.8
    if shape == "circle":
        return x * x + y * y <= 0.85
    if shape == "triangle":
        return (y >= -0.8) & (y <= 0.8) & (np.abs(x) <= (y + 0.8) / 1.6 * 0.9)
    return (np.abs(x) <= 0.25) | (np.abs(y) <= 0.25)  # cross


def word_ink(word: str, size: int) -> np.ndarray:
    """float [h, w] in [0, 1]: how ``word`` is written on a ``size``² picture (a third of its height, narrower
    than its half)."""
    return _glyphs(word, size // 3, size // 2 - 2 * (size // 24))


@cache
def _glyphs(word: str, height: int, max_width: int) -> np.ndarray:
    """float [h, w] in [0, 1]: ``word`` in Pillow's built-in font, cropped to its ink and scaled (bilinear) to
    ``height`` pixels, narrower when it would exceed ``max_width``."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    left, top, right, bottom = font.getbbox(word)
    canvas = Image.new("L", (right - left + 2, bottom - top + 2))
    ImageDraw.Draw(canvas).text((1 - left, 1 - top), word, fill=255, font=font)
    ink = canvas.crop(canvas.getbbox())
    scale = min(height / ink.height, max_width / ink.width)
    ink = ink.resize((max(1, round(ink.width * scale)), max(1, round(ink.height * scale))), Image.BILINEAR)
    return np.asarray(ink, np.float64) / 255.0


def _region(place: str, size: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the half of the picture on the ``place`` side."""
    half = size // 2
    return {"left": (0, size, 0, half), "right": (0, size, size - half, size),
            "top": (0, half, 0, size), "bottom": (size - half, size, 0, size)}[place]


def draw(colour: str, shape: str, place: str, word: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [size, size, 3]: the shape at ``place`` (its half of the image, jittered) on a noisy background,
    the word in the middle of the opposite half (jittered as much)."""
    img = rng.normal(110, 12, (size, size, 3)).clip(0, 255)
    box = size // 2 - size // 12
    lo, hi = size // 24, size - box - size // 24
    cx = {"left": lo, "right": hi}.get(place, (size - box) // 2)
    cy = {"top": lo, "bottom": hi}.get(place, (size - box) // 2)
    jitter = rng.integers(-size // 24, size // 24 + 1, 2)
    cy, cx = np.clip([cy + jitter[0], cx + jitter[1]], 0, size - box)
    shade = np.asarray(COLOURS[colour], np.float64) * rng.uniform(0.85, 1.0)
    img[cy: cy + box, cx: cx + box][_mask(shape, box)] = shade
    y0, y1, x0, x1 = _region(OPPOSITE[place], size)
    ink = word_ink(word, size)
    h, w = ink.shape
    j = min(size // 24, (x1 - x0 - w) // 2, (y1 - y0 - h) // 2)  # the letters stay inside their half
    jitter = rng.integers(-j, j + 1, 2)
    ty, tx = (y0 + y1 - h) // 2 + jitter[0], (x0 + x1 - w) // 2 + jitter[1]
    patch = img[ty: ty + h, tx: tx + w]
    img[ty: ty + h, tx: tx + w] = patch + (rng.uniform(225, 255) - patch) * ink[..., None]  # light letters
    return img.astype(np.uint8)


def example(i: int, seed: int = 0, size: int = 84) -> Example:
    """The ``i``-th synthetic pair of ``seed``: every attribute drawn uniformly."""
    rng = np.random.default_rng([seed, i])
    attrs = {name: str(rng.choice(values)) for name, values in ATTRIBUTES.items()}
    return Example(draw(**attrs, size=size, rng=rng), caption(**attrs), attrs)


class SyntheticSource:
    """A random-access source of ``n`` synthetic pairs (grain's ``MapDataset.source`` takes it)."""

    def __init__(self, n: int, seed: int = 0, size: int = 84):
        self.n, self.seed, self.size = n, seed, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, str]:
        ex = example(int(i), self.seed, self.size)
        return ex.rgb, ex.caption
