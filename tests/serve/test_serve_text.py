"""The server's text handling and prefix-cache tiers, without a model: chat template, streaming detokenisation,
stop strings, reasoning split; the host / disk tiers' lookups, LRU budgets, TTL and disk round trip."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from tokenizers import Tokenizer

from dsv41_jax.serve.prefix_cache import BLOCK, Entry, PrefixCache
from dsv41_jax.serve.text import ChatTemplate, ReasoningSplit, TemplateError, TextStream, effort_value


@pytest.fixture(scope="module")
def tok(golden_dir) -> Tokenizer:
    return Tokenizer.from_file(str(golden_dir / "tiny_hf" / "tokenizer.json"))


def test_chat_template_deepseek_format(tok, golden_dir):
    t = ChatTemplate.from_tokenizer_dir(golden_dir / "tiny_hf", tok, 0, 1)
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    assert t.render(msgs) == (f"{bos}Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello{eos}"
                              "<｜User｜>2+2?<｜Assistant｜></think>")
    # thinking mode with an effort preset (spec model §9.6: low / high / max = 50 / 75 / 100)
    assert t.render(msgs[1:2], thinking=True, effort=effort_value("max")) == \
        f"{bos}Reasoning Effort: 100<｜User｜>Hi<｜Assistant｜><think>"
    assert [effort_value(e) for e in ("low", "high", "max", 30)] == [50, 75, 100, 30]
    for bad, param in (([], "messages"), ([{"role": "tool", "content": "x"}], "messages[0].role")):
        with pytest.raises(TemplateError) as err:
            t.render(bad)
        assert err.value.param == param
    with pytest.raises(TemplateError, match="reasoning_effort"):
        effort_value("medium")
    # a chat_template from tokenizer_config.json replaces the built-in encoder
    jinja = ChatTemplate(bos, eos, "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                                   "{% if thinking %}<think>{% endif %}")
    assert jinja.render(msgs[1:2], thinking=True) == f"{bos}[user]Hi<think>"


def test_streaming_detokenisation_never_splits_a_character(tok):
    text = "你好，世界 hello"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # token by token, characters do split
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stop_strings_spanning_tokens(tok):
    text = "abc 你好，世界 tail"
    ids = tok.encode(text, add_special_tokens=False).ids
    for stop in ("好，世", " t", "c 你"):
        stream = TextStream(tok, (stop, "never"))
        out = ""
        for i in ids:
            out += stream.push(i)
            assert stop not in out  # held back while it may be forming
        out += stream.finish()
        assert stream.stopped and out == text[: text.index(stop)]
    stream = TextStream(tok, ("zzz",))
    assert "".join(stream.push(i) for i in ids) + stream.finish() == text


def test_reasoning_split_at_end_of_thinking():
    split = ReasoningSplit(True)
    parts = [split.push(p) for p in ("I think", " so</", "think>The ans", "wer")] + [split.push("", final=True)]
    assert "".join(r for r, _ in parts) == "I think so" and "".join(c for _, c in parts) == "The answer"
    assert ReasoningSplit(False).push("a</think>b") == ("", "a</think>b")


def _entry(tokens, salt="", seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 255, size=(len(tokens), 4), dtype=np.uint8)
    scales = rng.normal(size=(len(tokens), 2)).astype(ml_dtypes.float8_e4m3fn)
    carry = rng.normal(size=(8,)).astype(np.float32)
    return Entry(np.asarray(tokens, np.int64), [codes, scales, carry], salt)


def test_prefix_lookup_finds_the_longest_shared_prefix(rng):
    cache = PrefixCache(host_bytes=1 << 20, swa_bytes=1 << 20, swa_ttl=60)
    seqs = [rng.integers(4, 500, size=n) for n in (40, 70, 33)]
    seqs.append(np.concatenate([seqs[1][:50], rng.integers(4, 500, size=30)]))  # shares 50 with seqs[1]
    for i, s in enumerate(seqs):
        cache.put(_entry(s, seed=i), [np.full(3, i, np.uint8)] if i == 1 else None)
    for _ in range(30):  # against brute force over every entry
        base = seqs[rng.integers(len(seqs))]
        prompt = np.concatenate([base[: rng.integers(0, len(base) + 1)], rng.integers(4, 500, size=5)])
        cap = len(prompt) - 1
        shared = [int(np.argmin(np.append(s[:cap] == prompt[: min(cap, len(s))], False)))
                  if len(s) else 0 for s in seqs]
        want = max(shared)
        hit = cache.lookup(prompt, cap)
        if want < BLOCK:
            assert hit is None or hit.length >= BLOCK
            continue
        assert hit is not None and hit.length == want
        assert np.array_equal(hit.entry.tokens[:want], prompt[:want])
        assert (hit.rings is not None) == (hit.length == len(seqs[1]) and np.array_equal(hit.entry.tokens, seqs[1]))
    # another salt shares nothing
    assert cache.lookup(np.concatenate([seqs[0], [5]]), 40, salt="other") is None


def test_image_spans_key_the_prefix_cache_by_their_pixels(rng):
    """Two prompts with the same ids but different images share their text before the span and nothing from
    it on; the same image shares the whole prompt."""
    from dsv41_jax.serve.images import cache_keys, image_key
    from dsv41_jax.vision.spans import expand_prompt

    text = rng.integers(4, 500, size=2 * BLOCK + 3).tolist()
    span = expand_prompt([*text, 3, *rng.integers(4, 500, size=2 * BLOCK).tolist()], [(2, 3)], 3)
    red, blue = (cache_keys(span.ids, span.token_types, [d]) for d in (b"r" * 32, b"b" * 32))
    on_span = span.token_types >= 0
    assert np.array_equal(red[~on_span], span.ids[~on_span]) and (red[on_span] == image_key(b"r" * 32)).all()
    assert (red[on_span] < 0).all() and (red[on_span] != blue[on_span]).all()
    cache = PrefixCache(host_bytes=1 << 20, swa_bytes=1 << 20, swa_ttl=60)
    cache.put(_entry(red), None)
    assert cache.lookup(red, len(red) - 1).length == len(red) - 1
    assert cache.lookup(blue, len(blue) - 1).length == len(text)  # the text before the span, no more


def test_tiers_lru_ttl_and_disk_round_trip(tmp_path, rng):
    e = [_entry(rng.integers(4, 500, size=48), seed=i) for i in range(3)]
    size = e[0].nbytes
    cache = PrefixCache(host_bytes=2 * size, disk_dir=tmp_path, disk_bytes=10 * size, swa_bytes=1 << 20, swa_ttl=0.2)
    for x in e:
        cache.put(x, [np.zeros(4, np.uint8)])
    cache.flush()  # the disk tier is written by a thread of its own
    assert list(cache.host) == [k for k in list(cache.disk)[1:]]  # host keeps the two most recent
    hit = cache.lookup(np.concatenate([e[0].tokens, [7]]), 48)  # evicted from host: read back from disk
    assert hit.tier == "disk" and hit.length == 48 and hit.rings is not None
    for a, b in zip(hit.entry.arrays, e[0].arrays, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    time.sleep(0.25)  # the rings' time to live has passed: a whole-entry hit now replays
    assert cache.lookup(np.concatenate([e[1].tokens, [7]]), 48).rings is None
    cache.flush()
    # a new server finds the entries on disk (no rings: they are never persisted)
    again = PrefixCache(host_bytes=2 * size, disk_dir=tmp_path, disk_bytes=2 * size, swa_bytes=1 << 20, swa_ttl=60)
    assert len(again.disk) == 2 and not again.host  # the disk budget keeps two
    hit = again.lookup(np.concatenate([e[2].tokens, [7]]), 48)
    assert hit.tier == "disk" and hit.rings is None and np.array_equal(hit.entry.arrays[0], e[2].arrays[0])


def test_serve_settings_the_engine_refuses_are_one_line(golden_dir, capsys):
    from dsv41_jax.cli import main

    pytest.importorskip("fastapi")
    hf = str(golden_dir / "tiny_hf")
    assert main(["serve", "--hf-dir", hf, "--max-seq-len", "255"]) == 2
    assert main(["serve", "--hf-dir", hf, "--prefill-chunk", "4"]) == 2  # CED (the default) needs ≥ window
    err = capsys.readouterr().err
    assert "max_seq_len 255 must be a multiple of every compress ratio" in err and "prefill_chunk ≥ window" in err
