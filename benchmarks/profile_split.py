"""Split a profiled train step's device time between the model's parts.

    python benchmarks/profile_split.py DIR [--steps 2]

``DIR`` is what ``train_bench.py throughput ... --profile DIR`` wrote: a trace of ``--steps`` steps and the
compiled step's HLO. Every kernel in the trace names the HLO instruction it ran; the instruction's
``op_name`` carries the model's named scopes (``mhc``, ``attention``, ``indexer``, ``compressor``,
``indexer_loss``, ``moe``, ``engram``, ``head``, ``optimizer``; backward ops keep the scope of their forward
op). The innermost scope names the part; fusions without one take the majority of the ops they fuse.
Prints one JSON line per part (ms per step, share) and one for the total.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

PARTS = ("indexer_loss", "indexer", "compressor", "attention", "moe", "mhc", "engram", "head", "optimizer")
_SCOPE = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(PARTS) + r")(?![A-Za-z0-9_])")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')


def part_of(op_name: str) -> str | None:
    found = _SCOPE.findall(op_name)
    return found[-1] if found else None


def hlo_parts(text: str) -> dict[str, str]:
    """HLO instruction name -> part, from its own op_name or the majority of the computation it calls."""
    own, calls, members = {}, {}, collections.defaultdict(list)
    comp = None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMP.match(line)
            if c is not None and "=" not in line.split("{")[0]:
                comp = c.group(1)
            continue
        name = m.group(1)
        op = _OPNAME.search(line)
        own[name] = part_of(op.group(1)) if op else None
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
        if comp is not None:
            members[comp].append(name)
    parts = {}
    for name, part in own.items():
        if part is None and name in calls:
            votes = collections.Counter(own[i] for i in members.get(calls[name], ()) if own.get(i))
            part = votes.most_common(1)[0][0] if votes else None
        parts[name] = part or "other"
    return parts


def kernel_times(trace: dict) -> dict[str, float]:
    """hlo_op -> summed device time (µs) over the trace's kernel events (GPU streams, else any op events)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    streams = [e for e in ops if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    times = collections.Counter()
    for e in streams or ops:
        times[e["args"]["hlo_op"]] += float(e.get("dur", 0.0))
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    with gzip.open(os.path.join(args.directory, "step_hlo.txt.gz"), "rt") as f:
        parts = hlo_parts(f.read())
    (path,) = glob.glob(os.path.join(args.directory, "plugins", "profile", "*", "perfetto_trace.json.gz"))[-1:]
    with gzip.open(path, "rt") as f:
        times = kernel_times(json.load(f))
    per_part = collections.Counter()
    for op, us in times.items():
        per_part[parts.get(op, parts.get(op.split(":")[0], "other"))] += us
    total = sum(per_part.values())
    for part, us in per_part.most_common():
        print(json.dumps({"part": part, "ms_per_step": us / 1e3 / args.steps, "share": us / total}))
    unmatched = sum(us for op, us in times.items() if op not in parts)
    print(json.dumps({"part": "total", "ms_per_step": total / 1e3 / args.steps, "kernels": len(times),
                      "unmatched_share": unmatched / total if total else 0.0}))


if __name__ == "__main__":
    main()
