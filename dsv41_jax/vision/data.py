"""Image–text training data: pair sources, encoding, and packing that never splits an image span.

Sources (random access, so grain shuffles and shards them): the embedded synthetic pairs
(:mod:`dsv41_jax.vision.synthetic`), a folder with ``captions.jsonl`` (``{"image": "cat.png", "caption": "…"}``
per line, image paths relative to the folder), or WebDataset-style ``.tar`` shards (members ``KEY.png`` /
``KEY.jpg`` / ``KEY.jpeg`` with ``KEY.txt``, or ``KEY.json`` holding ``"caption"``).

A pair becomes one example ``[BOS] + image span + caption + [EOS]`` (spec model §7.3 layout) with its token
types, Engram row ids (hashed with a fresh history, the span DEAD) and the image's patches. Packing is whole
examples: a row takes examples while they fit and is padded after the last, so no span (nor caption) is ever
cut. Each row has room for ``max_images`` images; ``image_slot`` maps each IMAGE position to its aligner row
among the row's images. The packer's state is the index of the next example, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import grain
import numpy as np

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.vision.config import VisionTrainConfig
from dsv41_jax.vision.processor import GridPlan, decode_rgb, llm_grid, resize, to_patches
from dsv41_jax.vision.spans import IMAGE, TEXT, image_token_types
from dsv41_jax.vision.synthetic import SyntheticSource

_IMAGE_EXT = (".png", ".jpg", ".jpeg")


class FolderSource:
    """Pairs listed in ``DIR/captions.jsonl`` of each directory."""

    def __init__(self, dirs: tuple[str, ...]):
        self.items: list[tuple[Path, str]] = []
        for d in map(Path, dirs):
            index = d / "captions.jsonl"
            if not index.is_file():
                raise ConfigError(f"vision.paths: {d} has no captions.jsonl")
            for n, line in enumerate(index.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    self.items.append((d / rec["image"], str(rec["caption"])))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(f"{index}:{n}: expected {{\"image\": FILE, \"caption\": TEXT}}") from None
        if not self.items:
            raise ConfigError(f"vision.paths {list(dirs)}: no image–caption pairs")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[np.ndarray, str]:
        path, text = self.items[i]
        return decode_rgb(path), text


class TarSource:
    """WebDataset-style shards: an image member and a caption member per key."""

    def __init__(self, shards: tuple[str, ...]):
        self.items: list[tuple[str, str, str]] = []  # shard, image member, caption
        for shard in shards:
            with tarfile.open(shard) as tar:
                members = {m.name: m for m in tar.getmembers() if m.isfile()}
                for name in sorted(members):
                    key, ext = name.rsplit(".", 1) if "." in name else (name, "")
                    if f".{ext.lower()}" not in _IMAGE_EXT:
                        continue
                    text = self._caption(tar, members, key)
                    if text is None:
                        raise ConfigError(f"{shard}: image {name} has no {key}.txt or {key}.json caption")
                    self.items.append((shard, name, text))
        if not self.items:
            raise ConfigError(f"vision.paths {list(shards)}: no image members in the shards")

    @staticmethod
    def _caption(tar: tarfile.TarFile, members: dict, key: str) -> str | None:
        if f"{key}.txt" in members:
            return tar.extractfile(members[f"{key}.txt"]).read().decode().strip()
        if f"{key}.json" in members:
            return str(json.loads(tar.extractfile(members[f"{key}.json"]).read())["caption"])
        return None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[np.ndarray, str]:
        shard, name, text = self.items[i]
        with tarfile.open(shard) as tar:
            return decode_rgb(tar.extractfile(name).read()), text


def open_pairs(cfg: VisionTrainConfig, seed: int = 0):
    if cfg.source == "synthetic":
        return SyntheticSource(cfg.synthetic_examples, seed, cfg.image_size)
    if cfg.source == "folder":
        return FolderSource(cfg.paths)
    return TarSource(cfg.paths)


def training_grid(cfg: ModelConfig, image_size: int) -> GridPlan:
    """The one plan of every training image: ``image_size`` square, its LLM grid."""
    v = cfg.vision
    if image_size % v.patch_size:
        raise ConfigError(f"vision.image_size {image_size} must be a multiple of the patch size {v.patch_size}")
    n_h, n_w = llm_grid(image_size, image_size, v.patch_size, v.downsample_ratio)
    return GridPlan(n_h, n_w, image_size, image_size)


class EncodePair:
    """(rgb, caption) → one example: tokens, token_types, Engram rows, patches (a class so grain can name it)."""

    def __init__(self, tokenizer_path: Path, cfg: ModelConfig, token_map: np.ndarray, image_size: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))
        self.cfg, self.plan = cfg, training_grid(cfg, image_size)
        self.types = image_token_types(self.plan.n_llm_h, self.plan.n_llm_w)
        self.hasher = EngramHasher(cfg.engram, token_map) if cfg.engram.layer_ids else None

    def __call__(self, pair: tuple[np.ndarray, str]) -> dict[str, np.ndarray]:
        rgb, text = pair
        c = self.cfg
        ids = self.tok.encode(text, add_special_tokens=False).ids
        n_span = len(self.types)
        tokens = np.asarray([c.bos_token_id, *[c.image_token_id] * n_span, *ids, c.eos_token_id], np.int64)
        types = np.full(len(tokens), TEXT, np.int64)
        types[1: 1 + n_span] = self.types
        pixels = resize(rgb, self.plan, c.vision)
        out = {"tokens": tokens.astype(np.int32), "token_types": types.astype(np.int32),
               "patches": to_patches(pixels, c.vision.patch_size).astype(np.float32)}
        if self.hasher is not None:
            rows, _ = self.hasher.row_ids(tokens[None], types[None] >= 0)  # fresh history, span DEAD (§6.5)
            out["engram_rows"] = rows[0].astype(np.int32)
        return out


class PackedPairs:
    """Endless batches of rows packed with whole examples; ``get_state`` / ``set_state`` resume exactly."""

    def __init__(self, examples: grain.MapDataset, seq_len: int, rows: int, max_images: int, image_rows: int):
        self.examples, self.seq_len, self.rows = examples, seq_len, rows
        self.max_images, self.image_rows = max_images, image_rows
        self.next_index = 0

    def __iter__(self):
        return self

    def get_state(self) -> dict:
        return {"next_index": self.next_index}

    def set_state(self, state: dict) -> None:
        self.next_index = int(state["next_index"])

    def __next__(self) -> dict[str, np.ndarray]:
        return _stack([self._row() for _ in range(self.rows)])

    def _row(self) -> dict[str, np.ndarray]:
        parts = []
        used = 0
        while len(parts) < self.max_images:
            ex = self.examples[self.next_index]
            n = len(ex["tokens"])
            if n > self.seq_len:
                raise ConfigError(f"an image–text example of {n} tokens does not fit data.seq_len {self.seq_len} "
                                  "(a span is never split): raise data.seq_len or shorten the captions")
            if used + n > self.seq_len:
                break
            parts.append(ex)
            used += n
            self.next_index += 1
        return _pack_row(parts, self.seq_len, self.max_images, self.image_rows)


def _pack_row(parts: list[dict], seq_len: int, max_images: int, image_rows: int) -> dict[str, np.ndarray]:
    s = seq_len
    first = parts[0]
    out = {"tokens": np.zeros(s, np.int32), "token_types": np.full(s, TEXT, np.int32),
           "segment_ids": np.zeros(s, np.int32), "positions": np.zeros(s, np.int32),
           "image_slot": np.zeros(s, np.int32),
           "patches": np.zeros((max_images, *first["patches"].shape), np.float32)}
    if "engram_rows" in first:
        out["engram_rows"] = np.zeros((s, *first["engram_rows"].shape[1:]), np.int32)
    at = 0
    for j, ex in enumerate(parts):
        n = len(ex["tokens"])
        sl = slice(at, at + n)
        out["tokens"][sl], out["token_types"][sl] = ex["tokens"], ex["token_types"]
        out["segment_ids"][sl], out["positions"][sl] = j + 1, np.arange(n)
        slots = np.flatnonzero(ex["token_types"] == IMAGE)
        out["image_slot"][at + slots] = j * image_rows + np.arange(len(slots))
        out["patches"][j] = ex["patches"]
        if "engram_rows" in out:
            out["engram_rows"][sl] = ex["engram_rows"]
        at += n
    return out


def _stack(rows: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def packed_pairs(cfg: VisionTrainConfig, model_cfg: ModelConfig, tokenizer_path: Path, token_map: np.ndarray, *,
                 seq_len: int, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
                 ) -> PackedPairs:
    """Per-host batches [b, ...]: tokens / token_types / segment_ids / positions / image_slot int32 [b, S],
    engram_rows [b, S, L, G], patches float32 [b, max_images, T, 3, p, p] (zeros in unused slots)."""
    if batch_size % process_count:
        raise ConfigError(f"data.batch_size {batch_size} is not divisible by the {process_count} hosts")
    plan = training_grid(model_cfg, cfg.image_size)
    example_min = plan.span_len + 2  # BOS, span, EOS: an empty caption
    ds = grain.MapDataset.source(open_pairs(cfg, seed)).shuffle(seed=seed)[process_index::process_count]
    ds = ds.repeat(None).map(EncodePair(tokenizer_path, model_cfg, token_map, cfg.image_size))
    return PackedPairs(ds, seq_len, batch_size // process_count, max(1, seq_len // example_min),
                       plan.n_llm_h * plan.n_llm_w)
