"""Engram n-gram hashing on the host: token map, primes, offsets, multipliers and per-position row ids.

Hash layout (spec model §6.3–6.5). Each Engram layer owns one embedding table that is the concatenation
of ``n_columns = n_orders * n_heads`` bucket ranges. Column ``c = (order - 2) * n_heads + head`` covers the
order-``order`` n-gram (orders 2..max_ngram_size) hashed modulo its own prime; its rows start at
``offset[layer, c]`` = sum of the layer's earlier primes. For a token at absolute position p:

    tok_k  = compressed id at p-k, or pad once a look-back reaches the start or a DEAD (image) position
    prod_k = tok_k * m[layer, k]                  (int64; the bound keeps it below 2**63)
    h_n    = prod_0 ^ prod_1 ^ ... ^ prod_{n-1}   (XOR of the first n shifts = the n-gram hash)
    row    = h_n % prime[layer, n-2, head] + offset[layer, c]

All arithmetic is numpy int64 on the host; row ids depend only on token ids, so they are computed ahead
of the device graph (which receives them as int32, every table being < 2**31 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsv41_jax.config import EngramConfig

DEAD = -1  # compressed-id value of an image-span position (spec model §6.5)
_SENTINEL = "\ue000"  # protects a lone space from Strip (spec model §6.2)


# ----------------------------------------------------------------------------------------------------
# layout constants (spec model §6.3, §6.4)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_primes(cfg: EngramConfig) -> np.ndarray:
    """int64 [n_layers, n_orders, n_heads]: per (layer, order) the next n_heads unused primes > vocab_size-1.

    spec model §6.3: one ascending sequence, a global used-set, and each (layer, order) restarts the search
    from vocab_size - 1 taking primes strictly greater than it (tiny: start 60 → 61 is the first prime).
    """
    used: set[int] = set()
    out = np.zeros((len(cfg.layer_ids), cfg.n_orders, cfg.n_heads), np.int64)
    for li in range(len(cfg.layer_ids)):
        for o in range(cfg.n_orders):
            cand = cfg.vocab_size - 1
            for h in range(cfg.n_heads):
                cand += 1
                while not _is_prime(cand) or cand in used:
                    cand += 1
                used.add(cand)
                out[li, o, h] = cand
    return out


def engram_offsets(cfg: EngramConfig) -> np.ndarray:
    """int64 [n_layers, n_columns]: exclusive cumulative sum of each layer's primes (spec model §6.3)."""
    p = engram_primes(cfg).reshape(len(cfg.layer_ids), cfg.n_columns)
    return np.concatenate([np.zeros_like(p[:, :1]), np.cumsum(p, axis=1)[:, :-1]], axis=1)


def engram_multipliers(cfg: EngramConfig) -> np.ndarray:
    """int64 [n_layers, max_ngram_size]: odd per-shift multipliers from numpy's PCG64 (spec model §6.4)."""
    # the compressed vocab bounds the product id*m below 2**63 (spec model §6.4)
    bound = (2**63 - 1) // cfg.compressed_vocab_size // 2
    rows = []
    for layer_id in cfg.layer_ids:
        v = np.random.default_rng(10007 * layer_id).integers(0, bound, size=cfg.max_ngram_size, dtype=np.int64)
        rows.append(2 * v + 1)
    return np.stack(rows).astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# token compression (spec model §6.2)


def _key_normalizer():
    # the reference's own chain, run by the tokenizers library so Unicode tables (combining marks,
    # whitespace for Strip) are exactly the Rust ones (spec model §6.2 step 2)
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def build_token_map(tokenizer_json_path: str | Path) -> np.ndarray:
    """int64 [len(tokenizer)]: raw id → compressed id, ids assigned by first appearance of the key."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    norm = _key_normalizer()
    keys: dict[str, int] = {}
    n = tok.get_vocab_size(with_added_tokens=True)  # = len(tokenizer) in transformers
    out = np.empty(n, np.int64)
    for i in range(n):
        # raw backend decode: no transformers-level clean-up of spaces (spec model §6.2 step 1)
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:  # partial UTF-8 byte token: key by its raw string (spec model §6.2 step 2)
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = keys.setdefault(key, len(keys))
    return out


def check_token_map(token_map: np.ndarray, cfg: EngramConfig) -> None:
    """Raise ValueError unless the map has exactly cfg.compressed_vocab_size distinct ids (spec model §6.2 step 4)."""
    n = int(np.unique(np.asarray(token_map)).size)
    if n != cfg.compressed_vocab_size:
        raise ValueError(
            f"Engram token map has {n} distinct compressed ids but engram.compressed_vocab_size is "
            f"{cfg.compressed_vocab_size}; the hash multipliers depend on it, so every row id would change "
            f"(wrong tokenizer.json or config?)")


# ----------------------------------------------------------------------------------------------------
# per-position row ids (spec model §6.5)


@dataclass(frozen=True)
class EngramHistory:
    """What a sequence must carry between calls: the last max_ngram_size-1 compressed ids (DEAD = -1,
    oldest first) and how many positions it has seen (the absolute position of its next token)."""

    ids: np.ndarray  # int64 [B, max_ngram_size - 1]
    n_seen: np.ndarray  # int64 [B]


def history_init(batch: int, cfg: EngramConfig) -> EngramHistory:
    # slots before position 0 are blocked by the p < k test; DEAD fill blocks them a second way
    return EngramHistory(np.full((batch, cfg.max_ngram_size - 1), DEAD, np.int64), np.zeros(batch, np.int64))


class EngramHasher:
    """Holds the constant tables of one config and turns token ids into table row ids."""

    def __init__(self, cfg: EngramConfig, token_map: np.ndarray):
        self.cfg = cfg
        self.token_map = np.asarray(token_map, np.int64)
        self.primes = engram_primes(cfg).reshape(len(cfg.layer_ids), cfg.n_columns)  # [L, G]
        self.offsets = engram_offsets(cfg)  # [L, G]
        self.mults = engram_multipliers(cfg)  # [L, J]
        self.pad = np.int64(self.token_map[cfg.pad_id])  # spec model §6.2 step 5

    def history_init(self, batch: int) -> EngramHistory:
        return history_init(batch, self.cfg)

    def row_ids(self, token_ids, dead=None, history: EngramHistory | None = None):
        """token_ids int [B,S] (raw ids), dead bool [B,S] | None → (rows int64 [B,S,L,G], new history)."""
        cfg = self.cfg
        tok = np.asarray(token_ids, np.int64)
        b, s = tok.shape
        nk = cfg.max_ngram_size
        if history is None:
            history = self.history_init(b)
        comp = self.token_map[tok]
        if dead is not None:
            comp = np.where(np.asarray(dead, bool), np.int64(DEAD), comp)
        ext = np.concatenate([history.ids.astype(np.int64), comp], axis=1)  # [B, J-1+S]
        pos = history.n_seen.astype(np.int64)[:, None] + np.arange(s, dtype=np.int64)[None, :]  # absolute p

        blocked = np.zeros((b, s), bool)
        hashes = []  # hashes[n-2]: [B, S, L], the n-gram hash per layer
        h = None
        for k in range(nk):
            val = ext[:, nk - 1 - k: nk - 1 - k + s]  # id at p-k
            # once a look-back hits the start or a DEAD token, it and all larger shifts use pad (§6.5)
            blocked = blocked | (pos < k) | (val == DEAD)
            t = np.where(blocked, self.pad, val)
            prod = t[:, :, None] * self.mults[None, None, :, k]  # int64, wraps if ever needed, no floats
            h = prod if h is None else np.bitwise_xor(h, prod)
            if k >= 1:
                hashes.append(h)
        hs = np.stack(hashes, axis=-1)  # [B, S, L, n_orders]
        hs = np.repeat(hs, cfg.n_heads, axis=-1)  # column c = (n-2)*n_heads + head shares order n's hash
        rows = np.mod(hs, self.primes[None, None]) + self.offsets[None, None]
        new_hist = EngramHistory(ext[:, ext.shape[1] - (nk - 1):].copy(), history.n_seen.astype(np.int64) + s)
        return rows.astype(np.int64), new_hist


def row_ids(token_ids, dead, cfg: EngramConfig, token_map: np.ndarray, history: EngramHistory | None = None):
    """Functional form of EngramHasher.row_ids (spec model §6.5)."""
    return EngramHasher(cfg, token_map).row_ids(token_ids, dead, history)
