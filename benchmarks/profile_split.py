"""Split a profiled train step's device time between the model's parts.

    python benchmarks/profile_split.py DIR [--steps 2] [--top 40]

``DIR`` is what ``train_bench.py throughput ... --profile DIR`` wrote: a trace of ``--steps`` steps and the
compiled step's HLO. Every kernel in the trace names the HLO instruction it ran; the instruction's
``op_name`` carries the model's named scopes (``mhc``, ``attention``, ``indexer``, ``compressor``,
``indexer_loss``, ``moe``, ``engram``, ``head``, ``optimizer``; backward ops keep the scope of their forward
op). The innermost scope names the part; fusions without one take the majority of the ops they fuse. On GPU,
kernels replayed from a CUDA graph carry the instruction's name with '.' spelt '_', and Pallas (Triton) kernels
their kernel's name (``__N`` appended where names repeat), which the custom calls' backend configs give.
Prints one JSON line per part (ms per step, share) and one for the total; with ``--top N``, then the N
kernels (HLO instructions) that took the most time, each with its part, calls per step and the source scope
of its own op_name (or of the first op it fuses that has one).
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
# a Triton custom call's kernel name in its backend config (JSON, escaped or not, or MLIR attribute syntax)
_TRITON_NAME = re.compile(r'(?<!\w)\\?"?name\\?"?\s*[:=]\s*\\?"([\w.\-]+)')
_DEDUP = re.compile(r"__\d+$")


def part_of(op_name: str) -> str | None:
    found = _SCOPE.findall(op_name)
    return found[-1] if found else None


def _hlo_ops(text: str) -> tuple[dict[str, str], dict[str, str], dict[str, list[str]], dict[str, list[str]]]:
    """The HLO's instructions: name -> its own op_name ("" without one), name -> the computation it calls,
    computation -> its instructions, and Triton kernel name -> the op_names of the custom calls that launch it."""
    own, calls, members = {}, {}, collections.defaultdict(list)
    triton = collections.defaultdict(list)
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
        own[name] = op.group(1) if op else ""
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
        if comp is not None:
            members[comp].append(name)
        config = line.split("backend_config", 1)[1] if "backend_config" in line else ""
        if "xla.gpu.triton" in line and (kernel := _TRITON_NAME.search(config)):
            triton[kernel.group(1)].append(own[name])
    return own, calls, members, triton


def lookup(table: dict[str, str], kernel: str) -> str | None:
    """``table``'s entry for a kernel event's name: the instruction's, or for a Triton kernel (a Pallas call,
    replayed from a CUDA graph under its own name, with ``__N`` where names repeat) its kernel name's."""
    return table.get(kernel) or table.get(_DEDUP.sub("", kernel))


def hlo_parts(text: str) -> dict[str, str]:
    """HLO instruction name -> part, from its own op_name or the majority of the computation it calls."""
    own, calls, members, triton = _hlo_ops(text)
    own = {name: part_of(op) for name, op in own.items()}
    parts = {}
    for name, part in own.items():
        if part is None and name in calls:
            votes = collections.Counter(own[i] for i in members.get(calls[name], ()) if own.get(i))
            part = votes.most_common(1)[0][0] if votes else None
        parts[name] = parts[name.replace(".", "_")] = part or "other"  # GPU kernels: '.' spelt '_'
    for kernel, ops in triton.items():  # the majority of the custom calls launching it
        votes = collections.Counter(p for p in map(part_of, ops) if p)
        parts.setdefault(kernel, votes.most_common(1)[0][0] if votes else "other")
    return parts


def hlo_scopes(text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name, or for a fusion without one the op_name of the first of its members
    that has one (GPU kernel names: '.' spelt '_' too)."""
    own, calls, members, triton = _hlo_ops(text)
    scopes = {}
    for name, op in own.items():
        if not op and name in calls:
            op = next((own[i] for i in members.get(calls[name], ()) if own.get(i)), "")
        scopes[name] = scopes[name.replace(".", "_")] = op
    for kernel, ops in triton.items():
        scopes.setdefault(kernel, next((op for op in ops if op), ""))
    return scopes


def _kernels(trace: dict):
    """``(instruction, event)`` of every kernel event (GPU streams, else any op event). A kernel replayed from a
    CUDA graph has no instruction in ``hlo_op``: its name is the instruction's, or, for a library call
    (cuBLAS), the event carries the scope path in ``args.name``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    streams = [e for e in ops if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    for e in streams or ops:
        op = e["args"]["hlo_op"]
        yield (e["name"] if op.startswith("command_buffer") else op), e


def top_kernels(trace: dict, parts: dict[str, str], scopes: dict[str, str], n: int, steps: int) -> list[dict]:
    """The ``n`` kernels with the most device time: name, part, ms and calls per step, source scope."""
    times, calls, library = collections.Counter(), collections.Counter(), {}
    for op, e in _kernels(trace):
        times[op] += float(e.get("dur", 0.0))
        calls[op] += 1
        library.setdefault(op, e["args"].get("name", ""))
    out = []
    for op, us in times.most_common(n):
        scope = lookup(scopes, op) or library[op]
        out.append({"kernel": op, "part": lookup(parts, op) or part_of(scope) or "other",
                    "ms_per_step": us / 1e3 / steps, "calls_per_step": calls[op] / steps,
                    "scope": scope[-160:]})
    return out


def kernel_parts(trace: dict, parts: dict[str, str]) -> tuple[collections.Counter, float, int]:
    """Device time (µs) per part over the trace's kernel events (:func:`_kernels`), the time of kernels no part
    was found for, and the number of distinct kernels."""
    times, unmatched, names = collections.Counter(), 0.0, set()
    for op, e in _kernels(trace):
        part = lookup(parts, op) or part_of(e["args"].get("name", ""))
        if part is None:
            unmatched += float(e.get("dur", 0.0))
        names.add(op)
        times[part or "other"] += float(e.get("dur", 0.0))
    return times, unmatched, len(names)


def record(directory: str, compiled, run, steps: int = 2) -> None:
    """A device trace of ``steps`` calls of ``run()`` and ``compiled``'s HLO beside it, what :func:`main` reads.

    The trace's kernels are named after HLO instructions; the HLO's metadata names the source scope each
    instruction came from, which is how the time is split between model parts offline.
    """
    import jax

    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, "step_hlo.txt.gz"), "wt") as f:
        f.write(compiled.as_text())
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=0, help="also list the N kernels that took the most time")
    args = p.parse_args()
    with gzip.open(os.path.join(args.directory, "step_hlo.txt.gz"), "rt") as f:
        text = f.read()
    parts = hlo_parts(text)
    (path,) = glob.glob(os.path.join(args.directory, "plugins", "profile", "*", "perfetto_trace.json.gz"))[-1:]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    per_part, unmatched, n_kernels = kernel_parts(trace, parts)
    total = sum(per_part.values())
    for part, us in per_part.most_common():
        print(json.dumps({"part": part, "ms_per_step": us / 1e3 / args.steps, "share": us / total}))
    print(json.dumps({"part": "total", "ms_per_step": total / 1e3 / args.steps, "kernels": n_kernels,
                      "unattributed_share": unmatched / total if total else 0.0}))
    if args.top:
        for row in top_kernels(trace, parts, hlo_scopes(text), args.top, args.steps):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
