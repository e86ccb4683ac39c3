"""SFT data: prompt/response pairs in jsonl under a plain chat template, one conversation per padded row.

Chat template (tokens; ``|`` marks the prompt/response boundary, which is always a token boundary because the
two halves are encoded separately)::

    <bos> encode(user_prefix + prompt + assistant_prefix) | encode(response) <eos>

The special tokens are the tokenizer's ``<bos>`` and ``<eos>`` at the model config's ``bos_token_id`` /
``eos_token_id`` (0 and 1 for tokenizers trained by ``dsv41 train``); ``<pad>`` (``pad_token_id``) fills
the row after ``<eos>``. The role markers are plain text (``User: `` and ``\\n\\nAssistant:`` by default, keys
``posttrain.sft.user_prefix`` / ``assistant_prefix``), so any byte-level tokenizer encodes them. The loss
counts only the response tokens and ``<eos>``; the prompt length ``N`` is where the served prefill ends
(CED keeps prompt rows ``[N − W, N)``) and the cache-hit boundary is drawn inside ``[W, N)``.

A pair whose prompt leaves no room for a response token in ``seq_len`` is dropped; a long response is cut
at the row end (its ``<eos>`` then falls outside the row).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grain
import numpy as np

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.data.corpus import expand_paths
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.posttrain.config import SFTConfig


def read_pairs(paths: tuple[str, ...], prompt_key: str = "prompt", response_key: str = "response",
               limit: int = 100000) -> list[tuple[str, str]]:
    """Up to ``limit`` (prompt, response) string pairs from jsonl files (globs allowed), in file order."""
    pairs: list[tuple[str, str]] = []
    for path in expand_paths(tuple(paths)):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):  # pathlib or epath
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                pair = (str(obj[prompt_key]), str(obj[response_key]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{path}:{n + 1}: expected a JSON object with string keys {prompt_key!r} and "
                                  f"{response_key!r}: {err}") from err
            pairs.append(pair)
            if len(pairs) >= limit:
                return pairs
    return pairs


def encode_pair(tok, cfg: ModelConfig, sft: SFTConfig, prompt: str, response: str) -> tuple[np.ndarray, int]:
    """(token ids, prompt length N) of one conversation under the chat template."""
    head = tok.encode(sft.user_prefix + prompt + sft.assistant_prefix, add_special_tokens=False).ids
    body = tok.encode(response, add_special_tokens=False).ids
    ids = np.asarray([cfg.bos_token_id, *head, *body, cfg.eos_token_id], np.int32)
    return ids, 1 + len(head)


def sft_row(ids: np.ndarray, prompt_len: int, seq_len: int, cfg: ModelConfig,
            hasher: EngramHasher | None) -> dict[str, np.ndarray] | None:
    """One padded row: tokens, segment_ids (1 = token, 0 = pad), loss_mask (row t's target t+1 is a response
    token), prompt_len, and Engram row ids (fresh history); None if the prompt leaves no room for a response."""
    if prompt_len >= seq_len:
        return None
    ids = ids[:seq_len]
    n = len(ids)
    tokens = np.full((seq_len,), cfg.pad_token_id, np.int32)
    tokens[:n] = ids
    t = np.arange(seq_len)
    row = {"tokens": tokens, "segment_ids": (t < n).astype(np.int32),
           "loss_mask": (t + 1 >= prompt_len) & (t + 1 < n), "prompt_len": np.int32(prompt_len)}
    if hasher is not None:
        rows, _ = hasher.row_ids(ids[None].astype(np.int64))  # [1, n, L, C]
        padded = np.zeros((seq_len, *rows.shape[2:]), np.int32)
        padded[:n] = rows[0]
        row["engram_rows"] = padded
    return row


def sft_rows(pairs: list[tuple[str, str]], tokenizer_path: str | Path, cfg: ModelConfig, sft: SFTConfig,
             seq_len: int, token_map: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """Every pair that fits, as padded rows (see :func:`sft_row`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    hasher = EngramHasher(cfg.engram, token_map) if cfg.engram.layer_ids else None
    rows = [sft_row(*encode_pair(tok, cfg, sft, p, r), seq_len, cfg, hasher) for p, r in pairs]
    return [r for r in rows if r is not None]


def sft_dataset(rows: list[dict[str, np.ndarray]], *, batch_size: int, seed: int, process_index: int = 0,
                process_count: int = 1) -> grain.IterDataset:
    """Endless shuffled per-host batches of SFT rows (``batch_size`` is global)."""
    if batch_size % process_count:
        raise ConfigError(f"data.batch_size {batch_size} is not divisible by the {process_count} hosts")
    if len(rows) < process_count:
        raise ConfigError(f"{len(rows)} SFT rows cannot feed {process_count} hosts (are the prompts longer than "
                          "data.seq_len?)")
    ds = grain.MapDataset.source(rows).shuffle(seed=seed)[process_index::process_count]
    return ds.repeat(None).to_iter_dataset().batch(batch_size // process_count, drop_remainder=True)


@dataclasses.dataclass
class PosttrainData:
    """SFT batches, and the LM corpus batches (keys prefixed ``lm_``) when the LM objective is mixed in.

    Same interface as ``data.pipeline.DataState``: the loop stacks micro-batches and checkpoints the state.
    """

    sft: grain.DatasetIterator | None
    lm: grain.DatasetIterator | None = None

    def next(self, n: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for prefix, it in (("", self.sft), ("lm_", self.lm)):
            if it is not None:
                batches = [next(it) for _ in range(n)]
                out |= {prefix + k: np.stack([b[k] for b in batches]) for k in batches[0]}
        return out

    def state(self) -> dict:
        return {k: it.get_state() for k, it in (("sft", self.sft), ("lm", self.lm)) if it is not None}

    def restore(self, state: dict) -> None:
        for k, it in (("sft", self.sft), ("lm", self.lm)):
            if it is not None:
                it.set_state(state[k])


def pairs_from_documents(documents: list[str], n_pairs: int, prompt_lines: int = 12, seed: int = 0,
                         ) -> list[tuple[str, str]]:
    """Next-line completion pairs from code or text: ``prompt_lines`` consecutive non-blank lines of a
    document, and the non-blank line that follows them as the response (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    docs = [[ln for ln in d.splitlines() if ln.strip()] for d in documents]
    docs = [d for d in docs if len(d) > prompt_lines]
    if not docs:
        raise ConfigError(f"no document has more than {prompt_lines} non-blank lines")
    pairs = []
    for _ in range(n_pairs):
        lines = docs[rng.integers(len(docs))]
        i = int(rng.integers(len(lines) - prompt_lines))
        pairs.append(("\n".join(lines[i: i + prompt_lines]), lines[i + prompt_lines]))
    return pairs


def write_pairs(path: str | Path, pairs: list[tuple[str, str]], prompt_key: str = "prompt",
                response_key: str = "response") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p, r in pairs:
            f.write(json.dumps({prompt_key: p, response_key: r}) + "\n")
