"""``dsv41 serve`` on the golden checkpoint, driven by the real ``openai`` client.

One server process for the module (fp32, exact prefill, 4 batch rows, 4-step decode blocks), started by the
command line with a compilation cache in a temporary directory, so the restart at the end reads its programs
back instead of compiling them again. Requests that must run cold carry a ``cache_salt`` of their own: the
prefix cache never shares entries across salts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dsv41_jax.serve.prefix_cache import entry_key

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "tiny_hf"


class Server:
    def __init__(self, golden_dir, work, *extra: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, DSV41_COMPILE_CACHE=str(work / "xla"), JAX_PLATFORMS="cpu")
        cmd = [sys.executable, "-m", "dsv41_jax.cli", "serve", "--hf-dir", str(golden_dir / "tiny_hf"), "--dtype",
               "fp32", "--prefill-mode", "exact", "--max-batch", "4", "--max-seq-len", "256", "--prefill-chunk", "64",
               "--block", "4", "--max-queue", "16", "--port", str(self.port), "--prefix-cache-dir",
               str(work / "prefix"), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 900
        while not any(line.startswith("serving on") for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def metric(self, name: str) -> float:
        """The value of ``name`` (with its labels), or the sum over every label set of a bare name."""
        total = 0.0
        for line in urllib.request.urlopen(self.url + "/metrics").read().decode().splitlines():
            key, _, value = line.rpartition(" ")
            if key == name or ("{" not in name and key.startswith(name + "{")):
                total += float(value)
        return total

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(golden_dir, work):
    srv = Server(golden_dir, work)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _complete(srv, prompt, salt, **kw):
    r = srv.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                      extra_body={"return_token_ids": True, "cache_salt": salt, **kw.pop("extra", {})},
                                      **kw)
    return r, r.choices[0].model_extra["token_ids"]


def _wait(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_completion_and_logprobs_equal_the_reference(server, golden_dir):
    """Greedy tokens of the golden prompts equal the reference's greedy decode (which ``Generator`` and so
    ``dsv41 sample`` reproduce, tests/engine/test_sampling.py); logprobs equal the reference logits'
    log-softmax at each step, top-5 included."""
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ref = np.load(golden_dir / "ref_fp32.npz")
    for row in range(2):
        r, got = _complete(server, ids[row].tolist(), f"ref{row}", max_tokens=8, logprobs=5)
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
    r, got = _complete(server, "Hello world", "text", max_tokens=6)
    _, same = _complete(server, [0, *[int(t) for t in _encode(golden_dir, "Hello world")]], "ids", max_tokens=6)
    assert got == same and r.usage.prompt_tokens == 1 + len(_encode(golden_dir, "Hello world"))


def _encode(golden_dir, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(golden_dir / "tiny_hf" / "tokenizer.json")).encode(text,
                                                                                     add_special_tokens=False).ids


def test_streaming_equals_whole_responses_and_stops(server):
    whole, ids = _complete(server, "The quick brown fox", "s1", max_tokens=12)
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
    cut, _ = _complete(server, "The quick brown fox", "s3", max_tokens=12, stop=[stop])
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
    _wait(lambda: server.metric("dsv41_batch_occupancy") == 0)  # set after the last response went out


def test_disconnect_frees_the_row_and_overload_answers_429(server):
    before = server.metric("dsv41_requests_cancelled_total")
    stream = server.client.completions.create(model=MODEL, prompt="a long one", max_tokens=200, temperature=0,
                                              stream=True)
    next(iter(stream))
    stream.close()
    _wait(lambda: server.metric("dsv41_requests_cancelled_total") > before
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
    _, g1 = _complete(server, p1, "conv", max_tokens=8)
    p2 = p1 + g1 + ids[100:110]
    _, cold2 = _complete(server, p2, "cold2", max_tokens=8)
    hits = server.metric("dsv41_prefix_cache_hits_total")
    _, g2 = _complete(server, p2, "conv", max_tokens=8)
    assert g2 == cold2
    assert server.metric('dsv41_prefix_cache_hits_total{swa="live",tier="device"}') == 1
    p3 = p2 + g2 + ids[110:120]
    _, cold3 = _complete(server, p3, "cold3", max_tokens=8)
    with ThreadPoolExecutor(4) as pool:  # every row taken by someone else: the conversation leaves the device
        list(pool.map(lambda i: _complete(server, [0, 5 + i, 7], f"busy{i}", max_tokens=12), range(4)))
    _, g3 = _complete(server, p3, "conv", max_tokens=8)
    assert g3 == cold3
    assert server.metric('dsv41_prefix_cache_hits_total{swa="live",tier="host"}') == 1
    # shares 60 tokens with the conversation: global KV below 60 is reused, the window replayed
    p4 = p1[:60] + ids[120:140]
    _, g4 = _complete(server, p4, "conv", max_tokens=8)
    assert server.metric('dsv41_prefix_cache_hits_total{swa="replay",tier="host"}') == 1
    assert server.metric("dsv41_prefix_cache_hits_total") == hits + 3
    server.stop()
    # the restarted server must not find this very request's own conversation: remove it from the disk
    shutil.rmtree(work / "prefix" / entry_key(np.asarray(p4 + g4), "conv"))
    again = Server(golden_dir, work)
    try:
        assert any("conversations on disk" in line for line in again.lines)
        _, g4_again = _complete(again, p4, "conv", max_tokens=8)
        assert g4_again == g4
        assert again.metric('dsv41_prefix_cache_hits_total{swa="replay",tier="disk"}') == 1
    finally:
        again.stop()
