"""Synthetic image–caption pairs drawn on the fly: the embedded default of vision training (no download).

Example ``i`` of a seed is a deterministic function of ``(seed, i)``: one shape (square, circle, triangle,
cross) in one colour (red, green, blue, yellow) in one quadrant-like place (left, right, top, bottom) of a
noisy grey background, captioned ``"a red circle on the left"``. Every attribute is uniform, so a model that
does not look at the image names each one with probability 1/4 (:data:`ATTRIBUTES`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = ("left", "right", "top", "bottom")
ATTRIBUTES = {"colour": tuple(COLOURS), "shape": SHAPES, "place": PLACES}


class Example(NamedTuple):
    rgb: np.ndarray  # uint8 [H, W, 3]
    caption: str
    attributes: dict[str, str]


def caption(colour: str, shape: str, place: str) -> str:
    return f"a {colour} {shape} on the {place}"


def _mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """bool [size, size]: the shape, filling most of its box."""
    y, x = np.mgrid[0:size, 0:size] / (size - 1) * 2 - 1  # [-1, 1]²
    if shape == "square":
        return np.maximum(np.abs(x), np.abs(y)) <= 0.8
    if shape == "circle":
        return x * x + y * y <= 0.85
    if shape == "triangle":
        return (y >= -0.8) & (y <= 0.8) & (np.abs(x) <= (y + 0.8) / 1.6 * 0.9)
    return (np.abs(x) <= 0.25) | (np.abs(y) <= 0.25)  # cross


def draw(colour: str, shape: str, place: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [size, size, 3]: the shape at ``place`` (its half of the image, jittered) on a noisy background."""
    img = rng.normal(110, 12, (size, size, 3)).clip(0, 255)
    box = size // 2 - size // 12
    lo, hi = size // 24, size - box - size // 24
    cx = {"left": lo, "right": hi}.get(place, (size - box) // 2)
    cy = {"top": lo, "bottom": hi}.get(place, (size - box) // 2)
    jitter = rng.integers(-size // 24, size // 24 + 1, 2)
    cy, cx = np.clip([cy + jitter[0], cx + jitter[1]], 0, size - box)
    m = _mask(shape, box, rng)
    shade = np.asarray(COLOURS[colour], np.float64) * rng.uniform(0.85, 1.0)
    img[cy: cy + box, cx: cx + box][m] = shade
    return img.astype(np.uint8)


def example(i: int, seed: int = 0, size: int = 84) -> Example:
    """The ``i``-th synthetic pair of ``seed``: every attribute drawn uniformly."""
    rng = np.random.default_rng([seed, i])
    colour = str(rng.choice(list(COLOURS)))
    shape, place = str(rng.choice(SHAPES)), str(rng.choice(PLACES))
    return Example(draw(colour, shape, place, size, rng), caption(colour, shape, place),
                   {"colour": colour, "shape": shape, "place": place})


class SyntheticSource:
    """A random-access source of ``n`` synthetic pairs (grain's ``MapDataset.source`` takes it)."""

    def __init__(self, n: int, seed: int = 0, size: int = 84):
        self.n, self.seed, self.size = n, seed, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, str]:
        ex = example(int(i), self.seed, self.size)
        return ex.rgb, ex.caption
