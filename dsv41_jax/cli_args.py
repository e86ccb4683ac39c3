"""Argument types of the ``dsv41`` command: each checks its range, so a bad value is argparse's one line
(``dsv41 sample: error: argument --top-p: 1.5: must be in (0, 1]``) and exit code 2, before any work starts."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def at_least(low: float, kind: type = int):
    """An int (or float) ≥ ``low``."""

    def parse(text: str):
        value = _number(text, kind)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: must be ≥ {low}")
        return value

    parse.__name__ = f"{kind.__name__} ≥ {low}"
    return parse


def above(low: float, kind: type = float):
    """A float (or int) > ``low``."""

    def parse(text: str):
        value = _number(text, kind)
        if value <= low:
            raise argparse.ArgumentTypeError(f"{text}: must be > {low}")
        return value

    parse.__name__ = f"{kind.__name__} > {low}"
    return parse


def probability(text: str) -> float:
    """A float in (0, 1] (top-p: 1 keeps every token)."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1]")
    return value


def token_ids(text: str) -> list[int]:
    """``0,17,42`` -> ``[0, 17, 42]``: non-negative integers separated by commas."""
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not p.isdigit() for p in parts):
        bad = next((p for p in parts if not p.isdigit()), "")
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated non-negative token ids like 0,17,42 "
                                         f"({bad!r} is not one)")
    return [int(p) for p in parts]


def speculative(text: str) -> int:
    """``dspark`` -> 0 (the drafter's whole block), ``dspark:3`` -> 3 drafts verified per step."""
    method, _, k = text.partition(":")
    if method != "dspark" or (k and (not k.isdigit() or int(k) < 1)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected dspark or dspark:K with K ≥ 1 drafts per step")
    return int(k) if k else 0


def widths(text: str) -> tuple[int, ...]:
    """``1,2,5`` -> ``(1, 2, 5)``: the verify chunk's compiled widths (rows per request), each ≥ 1."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected widths ≥ 1 separated by commas, e.g. 1,2,5")
    return tuple(sorted({int(p) for p in parts}))


def boundaries(text: str) -> list[int | None]:
    """``cold,64,128`` -> ``[None, 64, 128]``: cache-hit positions (cold: no hit)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "cold":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{text!r}: expected 'cold' or positive positions, comma-separated "
                                             f"({part!r} is neither)")
    return out
