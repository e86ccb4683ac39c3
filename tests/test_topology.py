"""Per-layer roles: the release table of spec attention §1.2 and the tiny table of golden README §1, written
out literally (not derived with the library's rules), must equal what ``topology`` computes."""

from __future__ import annotations

import pytest

from dsv41_jax import config as C
from dsv41_jax.topology import describe, layer_spec, topology

FIELDS = ("layer", "part", "ratio", "role", "kv_source", "topk_source", "candidate_source", "uses_candidates",
          "engram", "rope")

# spec attention §1.2, one row per layer (ranges like "3–7" expanded); DSpark stages 40–42 at the end.
# columns: layer part ratio role kv-source top-k-source candidates(src/use/-) engram rope
RELEASE_TABLE = """
 0 encoder 0 swa     - -  -   -      plain
 1 encoder 0 swa     - -  -   engram plain
 2 encoder 2 full    2 2  -   -      yarn
 3 encoder 2 reuse   2 2  -   -      yarn
 4 encoder 2 reuse   2 2  -   -      yarn
 5 encoder 2 reuse   2 2  -   -      yarn
 6 encoder 2 reuse   2 2  -   -      yarn
 7 encoder 2 reuse   2 2  -   -      yarn
 8 encoder 2 full    8 8  -   -      yarn
 9 encoder 2 reuse   8 8  -   -      yarn
10 encoder 2 reuse   8 8  -   -      yarn
11 encoder 2 reuse   8 8  -   -      yarn
12 encoder 2 reuse   8 8  -   -      yarn
13 encoder 2 reuse   8 8  -   -      yarn
14 encoder 2 full   14 14 -   engram yarn
15 encoder 2 reuse  14 14 -   -      yarn
16 encoder 2 reuse  14 14 -   -      yarn
17 encoder 2 reuse  14 14 -   -      yarn
18 encoder 2 reuse  14 14 -   -      yarn
19 encoder 2 reuse  14 14 -   -      yarn
20 decoder 1 full   20 20 src -      yarn
21 decoder 1 reuse  20 20 -   -      yarn
22 decoder 1 reuse  20 20 -   -      yarn
23 decoder 1 reuse  20 20 -   -      yarn
24 decoder 1 reindex 20 24 use -     yarn
25 decoder 1 reuse  20 24 -   -      yarn
26 decoder 1 reuse  20 24 -   -      yarn
27 decoder 1 reuse  20 24 -   -      yarn
28 decoder 1 reindex 20 28 use -     yarn
29 decoder 1 reuse  20 28 -   -      yarn
30 decoder 1 reuse  20 28 -   -      yarn
31 decoder 1 reuse  20 28 -   -      yarn
32 decoder 1 reindex 20 32 use -     yarn
33 decoder 1 reuse  20 32 -   -      yarn
34 decoder 1 reuse  20 32 -   -      yarn
35 decoder 1 reuse  20 32 -   -      yarn
36 decoder 1 reindex 20 36 use -     yarn
37 decoder 1 reuse  20 36 -   -      yarn
38 decoder 1 reuse  20 36 -   -      yarn
39 decoder 1 reuse  20 36 -   -      yarn
40 draft   0 swa     - -  -   -      plain
41 draft   0 swa     - -  -   -      plain
42 draft   0 swa     - -  -   -      plain
"""

# golden README §1 (tiny_hf); the CED split is at the candidate source (6), as the release's is at 20.
TINY_TABLE = """
 0 encoder 0 swa     - -  -   -      plain
 1 encoder 0 swa     - -  -   engram plain
 2 encoder 2 full    2 2  -   -      yarn
 3 encoder 2 reuse   2 2  -   -      yarn
 4 encoder 2 full    4 4  -   engram yarn
 5 encoder 2 reuse   4 4  -   -      yarn
 6 decoder 1 full    6 6  src -      yarn
 7 decoder 1 reuse   6 6  -   -      yarn
 8 decoder 1 reindex 6 8  use -      yarn
 9 decoder 1 reuse   6 8  -   -      yarn
10 decoder 1 reindex 6 10 use -      yarn
11 decoder 1 reuse   6 10 -   -      yarn
12 draft   0 swa     - -  -   -      plain
13 draft   0 swa     - -  -   -      plain
14 draft   0 swa     - -  -   -      plain
"""


def _parse(table: str) -> list[tuple]:
    rows = []
    for line in table.strip().splitlines():
        layer, part, ratio, role, kv, topk, cand, engram, rope = line.split()
        rows.append((int(layer), part, int(ratio), role, None if kv == "-" else int(kv),
                     None if topk == "-" else int(topk), cand == "src", cand == "use", engram == "engram", rope))
    return rows


def _actual(cfg: C.ModelConfig) -> list[tuple]:
    n = cfg.n_layers + cfg.dspark.n_layers
    return [tuple(getattr(layer_spec(cfg, i), f) for f in FIELDS) for i in range(n)]


@pytest.mark.parametrize("preset, table", [(C.v41_flash, RELEASE_TABLE), (C.tiny, TINY_TABLE)],
                         ids=["release", "tiny"])
def test_table(preset, table):
    expected = _parse(table)
    actual = _actual(preset())
    assert len(actual) == len(expected)
    for exp, act in zip(expected, actual, strict=True):
        assert act == exp, "\n".join(f"{f}: expected {e!r} got {a!r}" for f, e, a in zip(FIELDS, exp, act, strict=True)
                                     if e != a)


@pytest.mark.parametrize("preset", [C.v41_flash, C.tiny], ids=["release", "tiny"])
def test_topology_is_backbone_only(preset):
    cfg = preset()
    specs = topology(cfg)
    assert [s.layer for s in specs] == list(range(cfg.n_layers))
    assert all(s.part != "draft" for s in specs)


def test_release_group_structure():
    # spec attention §1.2 prose: encoder = 2 SWA + 3 × (Full + 5 Reuse); decoder = (Full + 3 Reuse) +
    # 4 × (Reindex + 3 Reuse); checkpoint: 4 compressors, 3 with a gate, 8 indexers, 4 with index keys
    roles = "".join({"swa": "S", "full": "F", "reuse": "u", "reindex": "R"}[s.role] for s in topology(C.v41_flash()))
    assert roles == "SS" + "Fuuuuu" * 3 + "Fuuu" + "Ruuu" * 4
    specs = topology(C.v41_flash())
    assert [s.layer for s in specs if s.owns_compressor] == [2, 8, 14, 20]
    assert [s.layer for s in specs if s.owns_compressor and s.ratio > 1] == [2, 8, 14]  # compressor.wgate
    assert [s.layer for s in specs if s.has_indexer] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert [s.layer for s in specs if s.compressed] == list(range(2, 40))


def _signature(s) -> tuple:
    # everything that decides which weights a layer owns and which code path it runs
    return (s.part, s.ratio, s.role, s.candidate_source, s.uses_candidates, s.engram, s.rope,
            s.owns_compressor, s.has_indexer)


def test_every_release_role_exists_in_tiny():
    release, tiny = C.v41_flash(), C.tiny()
    n_rel, n_tiny = release.n_layers + release.dspark.n_layers, tiny.n_layers + tiny.dspark.n_layers
    missing = {_signature(layer_spec(release, i)) for i in range(n_rel)} - \
              {_signature(layer_spec(tiny, i)) for i in range(n_tiny)}
    assert not missing
    assert {s.role for s in topology(tiny)} == {"swa", "full", "reuse", "reindex"}
    # DSpark reads the last decoder layers in both
    for cfg in (release, tiny):
        assert cfg.dspark.target_layer_ids == tuple(range(cfg.n_layers - 3, cfg.n_layers))


def test_kv_and_topk_sources_are_owners():
    # every reader's sources own what it reads: the KV source a compressor, the top-k source an indexer
    for cfg in (C.v41_flash(), C.tiny()):
        for s in topology(cfg):
            if s.kv_source is not None:
                assert layer_spec(cfg, s.kv_source).owns_compressor
                assert layer_spec(cfg, s.kv_source).ratio == s.ratio
                assert s.kv_source <= s.topk_source <= s.layer
                assert layer_spec(cfg, s.topk_source).has_indexer


def test_describe_has_one_row_per_layer():
    text = describe(C.tiny())
    lines = text.splitlines()
    assert len(lines) == 1 + 12
    assert lines[7].split()[:4] == ["6", "decoder", "1", "full"] and "src" in lines[7]
