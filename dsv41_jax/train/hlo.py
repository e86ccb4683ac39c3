"""The collectives of a compiled program, read from its HLO text: what the SPMD partitioner inserted.

``collectives(compiled.as_text())`` lists every all-gather, all-reduce, reduce-scatter, all-to-all and
collective-permute with its operand and result types, the bytes each device sends into it (its operands),
the size of its device groups, the line of our code it was traced from, and how many times the same
instruction appears in the program. An instruction inside a loop body (the micro-batch scan) counts once per
appearance, not per trip.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# bits per element of the HLO element types
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64,
         "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4,
         "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8,
         "f8e4m3b11fnuz": 8, "f8e3m4": 8}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|[a-z][a-z0-9]*\[[0-9,]*\])")
_OP = re.compile(r"=\s*(?P<result>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<args>[^)]*)\)"
                 r"(?P<attrs>.*)$")


class Collective(NamedTuple):
    kind: str  # one of KINDS
    operands: tuple[str, ...]  # per-device operand types, e.g. ("f32[2,16,64]",)
    result: tuple[str, ...]  # per-device result types
    bytes: int  # operand bytes per device (what one device contributes)
    group: int  # devices per replica group (pairs for collective-permute)
    count: int  # appearances of this (kind, operands, result, group, source) in the program
    source: str  # "model/sparse.py:87 (jvp(jit(_take))/gather)": innermost traced line and the op it came from


def _arrays(text: str) -> tuple[str, ...]:
    return tuple(f"{t}[{dims}]" for t, dims in _ARRAY.findall(text) if t in _BITS)


def array_bytes(array: str) -> int:
    """Bytes of one array type written ``f32[2,16,64]``."""
    t, dims = _ARRAY.fullmatch(array).groups()
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _BITS[t] // 8


def _group_size(attrs: str, n_devices: int | None) -> int:
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs):  # mesh['a'=4,'b'=2] {'b'}
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes[axis]
        return n
    if m := re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs):  # iota form: [groups, size]<=[...]
        return int(m.group(1).split(",")[-1])
    if m := re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs):  # explicit: {{0,1},{2,3}}
        return len(m.group(1).split(","))
    if m := re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attrs):
        return m.group(1).count("{")
    return n_devices or 0  # replica_groups={}: every device


def _sections(lines: list[str]) -> dict[str, dict[int, str]]:
    """The module's source tables (FileNames, FileLocations, StackFrames, ...): id -> its text."""
    out: dict[str, dict[int, str]] = {}
    table = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = out.setdefault(line, {})
        elif table is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            table[int(m.group(1))] = m.group(2)
        else:
            table = None
    return out


def _source(attrs: str, tables: dict[str, dict[int, str]]) -> str:
    """``file:line (op)``: the innermost traced line (JAX records only that one by default) and the op name."""
    op = re.search(r'op_name="([^"]*)"', attrs)
    op = re.sub(r"^jit\([^)]*\)/|while/body/|closed_call/|vmap\(\)/", "", op.group(1)) if op else ""
    op = op.lstrip("(").split(":")[0]  # a combined op is named "(a:b:...)": keep the first part
    frame = re.search(r"stack_frame_id=(\d+)", attrs)
    frames, locs, files = (tables.get(k, {}) for k in ("StackFrames", "FileLocations", "FileNames"))
    loc_id = re.search(r"file_location_id=(\d+)", frames.get(int(frame.group(1)), "")) if frame else None
    loc = dict(re.findall(r"(\w+)=(\d+)", locs.get(int(loc_id.group(1)), ""))) if loc_id else {}
    path = files.get(int(loc.get("file_name_id", 0)), "").strip('"')
    where = f"{path.split('dsv41_jax/')[-1] if 'dsv41_jax/' in path else Path(path).name}:{loc['line']}" if path else ""
    return f"{where} ({op})" if where else op


def collectives(hlo_text: str, n_devices: int | None = None) -> list[Collective]:
    """Every collective of ``hlo_text`` (one compiled HLO module), grouped, largest total bytes first."""
    lines = [re.sub(r"/\*.*?\*/", "", line) for line in hlo_text.splitlines()]  # drop /*index=5*/ marks
    types = {d.group("name").lstrip("%"): d.group("type") for d in map(_DEF.match, lines) if d is not None}
    tables = _sections(lines)
    seen: dict[tuple, int] = {}
    for line in lines:
        m = _OP.search(line)
        if m is None:
            continue
        # operands print as names (their types are where they are defined) or, in some dumps, with their types
        args = [a.strip() for a in m.group("args").split(",") if a.strip()]
        operands = tuple(t for a in args for t in _arrays(types.get(a.split()[-1].lstrip("%"), a)))
        result = _arrays(m.group("result"))
        if m.group("start"):  # async form: the result tuple repeats the operands before the outputs
            result = result[len(operands):] or result
        attrs = m.group("attrs")
        key = (m.group("kind"), operands, result, _group_size(attrs, n_devices), _source(attrs, tables))
        seen[key] = seen.get(key, 0) + 1
    rows = [Collective(k, ops, res, sum(array_bytes(a) for a in ops), g, c, src)
            for (k, ops, res, g, src), c in seen.items()]
    return sorted(rows, key=lambda r: (-r.bytes * r.count, r.kind))


def _short(arrays: tuple[str, ...]) -> str:
    """Types of an operand list, repeats counted: ``f32[8,64] ×11, f32[4]``; long lists are cut."""
    out: list[list] = []
    for a in arrays:
        if out and out[-1][0] == a:
            out[-1][1] += 1
        else:
            out.append([a, 1])
    parts = [a if n == 1 else f"{a} ×{n}" for a, n in out]
    if len(parts) > 4:  # a combined all-reduce of many gradients: its size is in the bytes column
        return ", ".join(parts[:3]) + f", … ({len(arrays)} arrays)"
    return ", ".join(parts)


class Array(NamedTuple):
    type: str  # e.g. "f32[196608,5120]"
    bytes: int
    op: str  # the HLO opcode that produces it
    source: str
    count: int


_SKIP = ("parameter", "bitcast", "get-tuple-element", "tuple", "constant", "copy-start", "copy-done")


def largest_arrays(hlo_text: str, n: int = 5) -> list[Array]:
    """The ``n`` largest arrays the program materialises (outside fusion bodies), one row per type and source.

    A hint at what dominates XLA's temporary bytes, not a liveness analysis: buffers that are never live at the
    same time are counted each time, and tuple-shaped results (combined collectives) are left out.
    """
    lines = [re.sub(r"/\*.*?\*/", "", line) for line in hlo_text.splitlines()]
    tables = _sections(lines)
    seen: dict[tuple, list] = {}
    fused = False
    for line in lines:
        if not line.startswith(" "):  # a computation's header: skip what runs inside fusions
            fused = bool(re.match(r"^%?(fused|wrapped)", line))
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*([a-z][a-z0-9]*\[[0-9,]*\])\S*\s+([\w\-]+)\(", line)
        if fused or m is None or m.group(2) in _SKIP or m.group(1).split("[")[0] not in _BITS:
            continue
        key = (m.group(1), m.group(2), _source(line, tables))
        seen.setdefault(key, [0])[0] += 1
    rows = [Array(t, array_bytes(t), op, src, c[0]) for (t, op, src), c in seen.items()]
    return sorted(rows, key=lambda r: -r.bytes)[:n]


def format_collectives(rows: list[Collective]) -> str:
    """A table: kind, group, count, bytes per device, operand → result types."""
    if not rows:
        return "no collectives"
    lines = [f"{'kind':<19s} {'group':>5s} {'count':>5s} {'bytes/dev':>12s}  operands -> result  [traced at]"]
    for r in rows:
        ops, res = _short(r.operands), _short(r.result)
        lines.append(f"{r.kind:<19s} {r.group:>5d} {r.count:>5d} {r.bytes:>12,d}  {ops} -> {res}  [{r.source}]")
    totals: dict[str, int] = {}
    for r in rows:
        totals[r.kind] = totals.get(r.kind, 0) + r.bytes * r.count
    lines.append("total bytes/dev per appearance: " + ", ".join(f"{k} {v:,d}" for k, v in sorted(totals.items())))
    return "\n".join(lines)
