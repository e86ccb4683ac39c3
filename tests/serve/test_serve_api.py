"""``dsv41 serve`` on the golden checkpoint, driven by the real ``openai`` client.

A server process (fp32, exact prefill, 4 batch rows, 4-step decode blocks), started by the command line with a
compilation cache in a temporary directory, so the restart reads its programs back instead of compiling them
again; then a second one with CED prefill and images on the same cache (only its prefill programs are new),
checked against the engine's Generator in a child that reads every program back from that cache. Requests
that must run cold carry a ``cache_salt`` of their own: the prefix cache never shares entries across salts.
"""

from __future__ import annotations

import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dsv41_jax.serve.prefix_cache import entry_key

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serve_testing import MODEL, Server, complete, wait  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(golden_dir, work):
    srv = Server(golden_dir, work)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow  # over a minute on 2 CPU cores
def test_greedy_completion_and_logprobs_equal_the_reference(server, golden_dir):
    """Greedy tokens of the golden prompts equal the reference's greedy decode (which ``Generator`` and so
    ``dsv41 sample`` reproduce, tests/engine/test_sampling.py); logprobs equal the reference logits'
    log-softmax at each step, top-5 included."""
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ref = np.load(golden_dir / "ref_fp32.npz")
    for row in range(2):
        r, got = complete(server, ids[row].tolist(), f"ref{row}", max_tokens=8, logprobs=5)
        want = list(ref["batch2_decode_input_ids"][row])
        assert got == want and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (160, 8)
        logits = np.concatenate([ref["batch2_prefill_logits"][row, -1:], ref["batch2_decode_logits"][row, :7]])
        lp = _log_softmax(logits.astype(np.float64))
        np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, lp[np.arange(8), want], atol=2e-4)
        for step, top in enumerate(r.choices[0].logprobs.top_logprobs):  # ids that decode alike share a key
            best = np.sort(lp[step])[::-1][:5]
            assert all(np.abs(best - v).min() < 2e-4 for v in top.values()) and max(top.values()) == pytest.approx(
                best[0], abs=2e-4)
    # a text prompt is BOS + its tokens, as `dsv41 sample` encodes it
    r, got = complete(server, "Hello world", "text", max_tokens=6)
    _, same = complete(server, [0, *[int(t) for t in _encode(golden_dir, "Hello world")]], "ids", max_tokens=6)
    assert got == same and r.usage.prompt_tokens == 1 + len(_encode(golden_dir, "Hello world"))


def _encode(golden_dir, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(golden_dir / "tiny_hf" / "tokenizer.json")).encode(text,
                                                                                     add_special_tokens=False).ids


def test_streaming_equals_whole_responses_and_stops(server):
    whole, ids = complete(server, "The quick brown fox", "s1", max_tokens=12)
    stream = server.client.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=12,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True, "cache_salt": "s2"})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), []) == ids
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    # a stop string cuts the text before it (it may span tokens), finish_reason "stop"
    text = whole.choices[0].text
    stop = text[4:7]
    cut, _ = complete(server, "The quick brown fox", "s3", max_tokens=12, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # chat, thinking mode (reasoning_effort): reasoning and content deltas add up to the whole message
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}],
              temperature=0, max_tokens=10, reasoning_effort="high")
    msg = server.client.chat.completions.create(**kw, extra_body={"cache_salt": "c1"})
    parts = list(server.client.chat.completions.create(**kw, stream=True, extra_body={"cache_salt": "c2"}))
    deltas = [p.choices[0].delta for p in parts if p.choices]
    assert deltas[0].role == "assistant"
    got = msg.choices[0].message
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == got.model_extra[
        "reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == got.content
    assert msg.usage.prompt_tokens > 10 and msg.choices[0].finish_reason == "length"


def test_bad_requests_name_the_field(server):
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "best_offer": 3}, "best_offer"),
        ("/v1/completions", {"prompt": list(range(4, 300))}, "prompt"),
        ("/v1/completions", {"prompt": [0, 9999]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "medium"},
         "reasoning_effort"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50},
         "top_logprobs"),
    ]
    for path, body, param in cases:
        status, out = server.post(path, {"model": MODEL, **body})
        assert status == 400 and out["error"]["param"] == param, (body, out)
        assert out["error"]["type"] == "invalid_request_error" and param.split("[")[0] in out["error"]["message"]
    assert server.post("/v1/completions", b"{not json")[0] == 400
    status, out = server.post("/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and out["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    assert [m.id for m in server.client.models.list()] == [MODEL]


def test_concurrent_streams_equal_their_single_results(server, rng):
    """16 streaming clients with different lengths and settings share 4 rows: each result (greedy, or sampled
    with a seed) equals the same request made alone; nothing is lost and the server stays up. Four prompts
    take two or three prefill chunks, run one at a time between the running rows' decode blocks."""
    lengths = [int(rng.integers(100, 180)) if i % 5 == 0 else int(rng.integers(3, 14)) for i in range(16)]
    prompts = [[0, *rng.integers(4, 500, size=n).tolist()] for n in lengths]
    settings = [dict(temperature=0.9, top_p=1.0, extra={"top_k": 20}) if i % 4 == 0 else
                dict(temperature=0.7, top_p=0.8) if i % 4 == 1 else dict(temperature=0.0) for i in range(16)]

    def run(i, stream):  # a salt of its own: the single run must not find the concurrent run's conversation
        kw = dict(settings[i])
        extra = {"return_token_ids": True, "cache_salt": f"{stream}{i}", **kw.pop("extra", {})}
        r = server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=3 + (5 * i) % 17, seed=i,
                                             stream=stream, extra_body=extra, **kw)
        if not stream:
            return r.choices[0].model_extra["token_ids"]
        return sum((c.choices[0].model_extra["token_ids"] for c in r if c.choices), [])

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: run(i, True), range(16)))
    alone = [run(i, False) for i in range(16)]
    assert together == alone
    assert all(len(t) == 3 + (5 * i) % 17 or t[-1] == 1 for i, t in enumerate(together))
    wait(lambda: server.metric("dsv41_batch_occupancy") == 0)  # set after the last response went out


def test_disconnect_frees_the_row_and_overload_answers_429(server):
    before = server.metric("dsv41_requests_cancelled_total")
    stream = server.client.completions.create(model=MODEL, prompt="a long one", max_tokens=200, temperature=0,
                                              stream=True)
    next(iter(stream))
    stream.close()
    wait(lambda: server.metric("dsv41_requests_cancelled_total") > before
          and server.metric("dsv41_batch_occupancy") == 0)
    # 40 requests at once for 4 rows and a queue of 16: some are refused at once, the rest complete
    with ThreadPoolExecutor(40) as pool:
        out = list(pool.map(lambda i: server.post("/v1/completions", {"model": MODEL, "prompt": f"n{i}",
                                                                       "max_tokens": 2}), range(40)))
    statuses = [s for s, _ in out]
    assert set(statuses) == {200, 429}, statuses
    assert all(b["error"]["type"] == "rate_limit_error" for s, b in out if s == 429)
    assert urllib.request.urlopen(server.url + "/health").status == 200


def test_prefix_cache_tiers_and_restart(server, golden_dir, work, rng):
    """A continued conversation resumes from the device tier (its row) and, after the row is reused, from the
    host tier with its SWA rings still live: both give the tokens of a cold run. A partial hit replays the
    window (encoder bounded replay); after a restart the same request is served from disk the same way."""
    ids = np.load(golden_dir / "inputs.npz")["batch1_ids"][0].tolist()
    p1 = ids[:100]
    _, g1 = complete(server, p1, "conv", max_tokens=8)
    p2 = p1 + g1 + ids[100:110]
    _, cold2 = complete(server, p2, "cold2", max_tokens=8)
    hits = server.metric("dsv41_prefix_cache_hits_total")
    _, g2 = complete(server, p2, "conv", max_tokens=8)
    assert g2 == cold2
    assert server.metric('dsv41_prefix_cache_hits_total{swa="live",tier="device"}') == 1
    p3 = p2 + g2 + ids[110:120]
    _, cold3 = complete(server, p3, "cold3", max_tokens=8)
    with ThreadPoolExecutor(4) as pool:  # every row taken by someone else: the conversation leaves the device
        list(pool.map(lambda i: complete(server, [0, 5 + i, 7], f"busy{i}", max_tokens=12), range(4)))
    _, g3 = complete(server, p3, "conv", max_tokens=8)
    assert g3 == cold3
    assert server.metric('dsv41_prefix_cache_hits_total{swa="live",tier="host"}') == 1
    # shares 60 tokens with the conversation: global KV below 60 is reused, the window replayed
    p4 = p1[:60] + ids[120:140]
    _, g4 = complete(server, p4, "conv", max_tokens=8)
    assert server.metric('dsv41_prefix_cache_hits_total{swa="replay",tier="host"}') == 1
    assert server.metric("dsv41_prefix_cache_hits_total") == hits + 3
    server.stop()
    # the restarted server must not find this very request's own conversation: remove it from the disk
    shutil.rmtree(work / "prefix" / entry_key(np.asarray(p4 + g4), "conv"))
    again = Server(golden_dir, work)
    try:
        assert any("conversations on disk" in line for line in again.lines)
        _, g4_again = complete(again, p4, "conv", max_tokens=8)
        assert g4_again == g4
        assert again.metric('dsv41_prefix_cache_hits_total{swa="replay",tier="disk"}') == 1
    finally:
        again.stop()


# -- CED prefill and images: a second server, CED prefill, on the same compilation cache (its decode block and
# row transfers are the first server's programs), checked against the engine's Generator as `dsv41 sample` runs it
# with the same shapes

IMAGE_TEXT = "<｜User｜><image>Name it.<｜Assistant｜></think>"  # the chat template's rendering, `sample` spelling


@pytest.fixture(scope="module")
def media(work, golden_dir):
    """Two images of one size (one compiled tower): the golden image and its mirror."""
    from PIL import Image, ImageOps

    folder = work / "media"
    folder.mkdir()
    shutil.copy(golden_dir / "vision_image_0.png", folder / "a.png")
    with Image.open(folder / "a.png") as im:
        ImageOps.mirror(im).save(folder / "b.png")
    return folder


@pytest.fixture(scope="module")
def ced(golden_dir, work, media):
    # one chunk holds every prompt here: CED's final-chunk program is the only prefill (text, and image) it needs
    srv = Server(golden_dir, work, "--prefill-mode", "ced", "--prefill-chunk", "256", "--allowed-local-media-path",
                 str(media), prefix_dir="prefix-ced")
    yield srv
    srv.stop()


def _image_chat(srv, url: str, salt: str = ""):
    r = srv.client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "Name it."}]}],
        extra_body={"return_token_ids": True, "cache_salt": salt})
    return r.choices[0].model_extra["token_ids"]


def _data_url(path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _generator(work, golden_dir, **request) -> dict:
    """The child's greedy ids, its programs read back from the servers' compilation cache."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (work / "request.json").write_text(json.dumps({"hf_dir": str(golden_dir / "tiny_hf"), **request}))
    env = dict(os.environ, DSV41_COMPILE_CACHE=str(work / "xla"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("generator_child.py")),
                          str(work / "request.json")], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_ced_prefill_and_image_chats_equal_the_generator(ced, golden_dir, work, media):
    """A CED server's greedy tokens equal the Generator's with CED prefill (as `dsv41 sample --prefill-mode ced`):
    a cold prompt; its continuation by a prefix-cache hit that feeds ≥ window new tokens (CED then truncates the
    decoder windows at the same row as a cold CED prefill of the whole, and the layers below the cut are exact
    either way, so the hit equals the cold run); and image chats (`image_url` parts, as a data: URL and as a
    file:// URL) equal `sample --image`. Two different images behind the same token ids each get their own
    tokens: the second misses the first one's cached conversation (keys hold the pixels' hash), while the same
    pixels sent another way hit it."""
    ids = np.load(golden_dir / "inputs.npz")["batch1_ids"][0].tolist()
    p1 = ids[:100]
    _, g1 = complete(ced, p1, "ced", max_tokens=8)
    p2 = p1 + g1 + ids[100:110]
    _, g2 = complete(ced, p2, "ced", max_tokens=8)
    assert ced.metric('dsv41_prefix_cache_hits_total{swa="live",tier="device"}') == 1
    a = _image_chat(ced, _data_url(media / "a.png"))
    misses, hits = ced.metric("dsv41_prefix_cache_misses_total"), ced.metric("dsv41_prefix_cache_hits_total")
    b = _image_chat(ced, (media / "b.png").as_uri())  # the same ids as a's prompt: without image keys, a hit
    assert ced.metric("dsv41_prefix_cache_misses_total") == misses + 1
    assert ced.metric("dsv41_prefix_cache_hits_total") == hits
    _image_chat(ced, (media / "a.png").as_uri())  # a's pixels again (as a file): a's conversation is found
    assert ced.metric("dsv41_prefix_cache_hits_total") == hits + 1
    want = _generator(work, golden_dir, prefill_mode="ced", prefill_chunk=256, max_new=8, ids=[p1, p2, p1, p2],
                      texts=[IMAGE_TEXT] * 4, images=[str(media / n) for n in ("a.png", "b.png", "a.png", "b.png")])
    assert [g1, g2] == want["ids"][:2]
    assert [a, b] == want["images"][:2] and a != b


def test_bad_images_name_the_field(ced, media, golden_dir):
    good = {"type": "image_url", "image_url": {"url": _data_url(media / "a.png")}}
    field = "messages[0].content[1].image_url.url"
    cases = [
        ("data:image/png;base64," + "iVBORw0KGgo" * 4, field, "cannot decode"),
        ("data:text/plain;base64,aGk=", field, "must hold an image"),
        ("https://example.com/cat.png", field, "remote image URLs are not fetched"),
        (str(golden_dir / "vision_image_1.png"), field, "outside the allowed local media path"),
        ((media / "missing.png").as_uri(), field, "no such image file"),
        ("", field, "at least 1 character"),
    ]
    for url, param, message in cases:
        content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
        status, out = ced.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                      "content": content}]})
        assert status == 400 and out["error"]["param"] == param and message in out["error"]["message"], (url, out)
    # the text spells the image token itself: one placeholder too many
    status, out = ced.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [good, {"type": "text", "text": "<｜deepseek_image｜>"}]}]})
    assert status == 400 and out["error"]["param"] == "messages" and "2 image placeholder" in out["error"]["message"]
    status, out = ced.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"link": "x"}}]}]})
    assert status == 400 and out["error"]["param"] == "messages[0].content[0].image_url.url", out
