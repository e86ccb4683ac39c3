"""A ``dsv41 serve`` process for tests, driven by the real ``openai`` client, and small helpers around it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

MODEL = "tiny_hf"


class Server:
    """``dsv41 serve`` of the golden checkpoint (fp32, 4 batch rows, 4-step decode blocks, 64-token prefill
    chunks, 256 positions), with its compilation cache and prefix cache in ``work``; ``extra`` adds or
    overrides flags (argparse keeps the last value)."""

    def __init__(self, golden_dir, work, *extra: str, prefix_dir: str = "prefix", env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, DSV41_COMPILE_CACHE=str(work / "xla"), JAX_PLATFORMS="cpu", **(env or {}))
        cmd = [sys.executable, "-m", "dsv41_jax.cli", "serve", "--hf-dir", str(golden_dir / "tiny_hf"), "--dtype",
               "fp32", "--prefill-mode", "exact", "--max-batch", "4", "--max-seq-len", "256", "--prefill-chunk", "64",
               "--block", "4", "--max-queue", "16", "--port", str(self.port), "--prefix-cache-dir",
               str(work / prefix_dir), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 900
        while not self._healthy():  # "serving on" is logged just before uvicorn opens the port
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def _healthy(self) -> bool:
        if not any(line.startswith("serving on") for line in self.lines):
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:  # not listening yet
            return False

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


def complete(srv: Server, prompt, salt: str, **kw):
    """A greedy completion with its generated ids."""
    r = srv.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                      extra_body={"return_token_ids": True, "cache_salt": salt, **kw.pop("extra", {})},
                                      **kw)
    return r, r.choices[0].model_extra["token_ids"]


def wait(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
