"""``sample.TextStream``: decode blocks shown as text without splitting a character (a real byte-level tokenizer)."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dsv41_jax.sample import TextStream

TOKENIZER = Path(__file__).parent / "data" / "golden" / "tiny_hf" / "tokenizer.json"
TEXT = "héllo 日本語 ok"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER))


def _blocks(ids, n):
    return [ids[i:i + n] for i in range(0, len(ids), n)]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_a_streamed_row_shows_whole_characters_and_ends_with_the_whole_text(tok, size):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > len(TEXT)  # the CJK characters span several byte tokens each
    pieces, started = [], []
    stream = TextStream(tok, 1, write=pieces.append, start=lambda: started.append(True))
    for block in _blocks(ids, size):
        stream([block])
        assert "\ufffd" not in "".join(pieces)
    stream.finish()
    assert started == [True]
    assert "".join(pieces) == tok.decode(ids) + "\n" == TEXT + "\n"


def test_a_generation_that_ends_mid_character_shows_its_tail_at_the_end(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    whole = next(n for n in range(len(ids)) if tok.decode(ids[:n]) == "héllo 日本語")
    cut = ids[:whole - 1]  # 語 without its last byte
    pieces = []
    stream = TextStream(tok, 1, write=pieces.append)
    for block in _blocks(cut, 2):
        stream([block])
    held = "".join(pieces)
    assert held == "héllo 日本"  # the incomplete 語 is held back while blocks arrive
    stream.finish()
    assert "".join(pieces) == tok.decode(cut) + "\n" and tok.decode(cut).endswith("\ufffd")


def test_rows_are_logged_with_their_index_and_stopped_rows_add_nothing(tok):
    """Log lines carry whole characters and no blank line; a blank delta waits for the text after it."""
    a = tok.encode("ab 日", add_special_tokens=False).ids
    b = tok.encode("xyz", add_special_tokens=False).ids
    lines = []
    stream = TextStream(tok, 2, log=lines.append)
    width = max(len(a), len(b))
    rows = [a + [-1] * (width - len(a)), b + [-1] * (width - len(b))]
    for k in range(0, width, 2):
        stream([r[k:k + 2] for r in rows])
    stream.finish()
    shown = {i: "".join(line[len(f"[{i}] "):] for line in lines if line.startswith(f"[{i}] ")) for i in (0, 1)}
    assert shown == {0: "ab 日", 1: "xyz"}
