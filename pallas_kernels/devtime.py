"""Device time of a jitted call from a profiler trace: the sum of its kernels' durations per call.

A host clock around back-to-back calls measures the device only while the device is the slower side. On
the H200 a jitted call takes ~40-50 µs of host time to dispatch, so a call whose kernels run for less than
that is timed as the host's dispatch rate. The trace has each kernel's start and duration on the GPU's
streams, so ``busy_us`` (the kernels' summed time) is the device time whatever the host does, and
``span_us`` (first kernel start to last kernel end, per call) adds the gaps between a call's kernels.

GPU only: elsewhere the trace has no device streams and :func:`device_time` returns ``None``.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def stream_kernels(trace) -> list[dict]:
    """The complete ("X") events on the trace's GPU stream threads (thread names starting ``Stream``)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X" and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]


def summarize(kernels: list[dict], calls: int, top: int = 6) -> dict:
    """Per call: summed kernel time, first-start-to-last-end span, kernel count, the costliest kernels
    (name -> µs per call) and the last call's kernels in order."""
    if not kernels:
        return {"busy_us": None, "span_us": None, "kernels_per_call": 0, "top": {}}
    busy = sum(float(e.get("dur", 0.0)) for e in kernels)
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels)
    by_name = collections.Counter()
    for e in kernels:
        by_name[e.get("name", "?")[:80]] += float(e.get("dur", 0.0))
    ordered = sorted(kernels, key=lambda e: float(e["ts"]))
    per_call = len(kernels) // calls if len(kernels) % calls == 0 else 0
    return {"busy_us": round(busy / calls, 2), "span_us": round((end - start) / calls, 2),
            "kernels_per_call": round(len(kernels) / calls, 2),
            "top": {k: round(v / calls, 2) for k, v in by_name.most_common(top)},
            # the last call's kernels in launch order (when every call launched as many)
            "last_call": [[e.get("name", "?")[:48], round(float(e.get("dur", 0.0)), 2)]
                          for e in ordered[len(ordered) - per_call:]] if per_call else []}


def _profile(run, calls: int) -> dict | None:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        paths = glob.glob(os.path.join(d, "plugins", "profile", "*", "perfetto_trace.json.gz"))
        if not paths:
            return None
        with gzip.open(sorted(paths)[-1], "rt") as f:
            return summarize(stream_kernels(json.load(f)), calls)


def device_time(fn, *args, calls: int = 20, warmup: int = 2) -> dict | None:
    """Profile ``calls`` back-to-back calls of ``fn(*args)``; :func:`summarize` of their kernels, or
    ``None`` off GPU."""
    if jax.default_backend() != "gpu":
        return None
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return _profile(lambda: jax.block_until_ready([fn(*args) for _ in range(calls)]), calls)


def device_time_carry(fn, carry, *args, calls: int = 20, warmup: int = 2) -> dict | None:
    """:func:`device_time` for ``carry = fn(carry, *args)`` with ``carry`` donated (an in-place update such
    as a cache write: each call consumes the previous call's output, so no call copies the carry)."""
    if jax.default_backend() != "gpu":
        return None
    for _ in range(warmup):
        carry = jax.block_until_ready(fn(carry, *args))

    def run():
        c = carry
        for _ in range(calls):
            c = fn(c, *args)
        jax.block_until_ready(c)

    return _profile(run, calls)
