"""The sharded train step compiled from shapes alone on 8 fake CPU devices (``collectives_child.py``).

What the SPMD partitioner inserted is read from the compiled HLO (``dsv41_jax.train.hlo``): the CSA2 shared
state stays split over the batch (no collective ever moves it), the collectives the design calls for are there,
and XLA's per-device argument bytes are exactly the preflight's parameter + optimizer bytes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dsv41_jax import config as C
from dsv41_jax.optim import OptimConfig
from dsv41_jax.testing import run_on_fake_cpus
from dsv41_jax.train.hlo import Collective
from dsv41_jax.train.preflight import preflight

MOVES = ("all-gather", "all-to-all", "collective-permute")  # collectives that move rows between devices
# the CSA2 attention and mHC code: everything it touches is activations or shared state, split over the batch
CSA2_FILES = ("model/attention.py", "model/sparse.py", "model/indexer.py", "model/compressor.py",
              "model/documents.py", "model/mhc.py")


@pytest.fixture(scope="module")
def compiled() -> dict:
    out = run_on_fake_cpus(Path(__file__).with_name("collectives_child.py"), 8, compile_only=True)[-1]
    out["rows"] = [Collective(**{**r, "operands": tuple(r["operands"]), "result": tuple(r["result"])})
                   for r in out["rows"]]
    return out


def _dims(array: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.fullmatch(r"\w+\[([0-9,]*)\]", array).group(1).split(",") if d)


def _signature(array: str) -> tuple[str, tuple[int, ...]]:
    """``f32[8,40,96]`` -> ``("f32", (40, 96))``: element type and the dimensions after the batch."""
    return array.split("[")[0], _dims(array)[1:]


def _shared_state(r: dict) -> dict[tuple, str]:
    """Element type and per-row shape of every CSA2 shared-state array, and of the scores top-k reads."""
    s, out = r["seq"], {}
    for c in (s // m for m in r["ratios"]):
        out[("f32", (c, r["head_dim"]))] = "main KV"
        out.setdefault(("f32", (c, r["index_head_dim"])), "index keys")
        out[("f32", (s, c))] = "index scores (top-k input)"
    out[("s32", (s, r["topk"]))] = "top-k"
    out[("pred", (s, r["candidate_blocks"]))] = "candidate blocks"
    out[("f32", (s, r["candidate_blocks"]))] = "candidate block scores (top-k input)"
    out[("f32", (s, r["experts"]))] = "router scores (top-k input)"
    return out


@pytest.mark.slow  # one compile of the whole step in an 8-device child (~1-2 min on a loaded 2-core CPU)
def test_shared_state_stays_split_over_the_batch(compiled):
    """No all-gather, all-to-all or collective-permute carries main KV, index keys, top-k, candidates or the
    scores a top-k reads (each would put another device's rows on this one), and none is traced in the CSA2 /
    mHC code at all. Without ``sharding.batch_local``, XLA all-gathers every top-k input over all 8 devices;
    without the block-boundary constraints, the mHC streams are gathered."""
    shared = _shared_state(compiled)
    moved = [(shared[_signature(a)], r) for r in compiled["rows"] if r.kind in MOVES
             for a in r.operands + r.result if _signature(a) in shared]
    assert not moved, moved
    rows = {compiled["seq"] // m for m in [1, *compiled["ratios"]]}  # tokens or compressed entries per row
    of_batch = lambda a: (d := _dims(a)) and len(d) >= 2 and d[0] <= compiled["batch"] and d[1] in rows
    in_csa2 = [r for r in compiled["rows"] if r.kind in MOVES and r.source.startswith(CSA2_FILES)
               and any(map(of_batch, r.operands + r.result))]  # (their weights' FSDP gathers are planned)
    assert not in_csa2, in_csa2
    assert not [r for r in compiled["rows"] if "top_k" in r.source], compiled["rows"]


@pytest.mark.slow
def test_the_planned_collectives_are_there(compiled):
    """Gradients are summed over the batch shards; the expert-parallel MoE gathers its expert group's tokens
    and reduce-scatters the partial outputs over the ``expert`` axis (2 devices)."""
    rows = compiled["rows"]
    # replicated parameters (norms, mHC vectors, ...) get their gradient summed over all data × fsdp × expert
    assert any(r.kind == "all-reduce" and r.group == 8 and "f32[64]" in r.operands for r in rows), rows
    moe = [r for r in rows if r.source.startswith("model/moe.py") and r.group == 2]
    assert any(r.kind == "all-gather" and "shard_map/all_gather" in r.source for r in moe), rows
    assert any(r.kind == "reduce-scatter" and "shard_map/reduce_scatter" in r.source for r in moe), rows


@pytest.mark.slow
def test_xla_argument_bytes_equal_the_preflight(compiled):
    """XLA's per-device argument bytes = the preflight's exact parameter + router-bias + optimizer bytes
    (from the sharding table) + the step counter + this device's rows of the batch."""
    tiny = C.tiny()
    cfg = tiny.replace(dtype="float32", attention=dataclasses.replace(
        tiny.attention, head_dim=compiled["head_dim"], index_head_dim=compiled["index_head_dim"]))
    p = preflight(cfg, OptimConfig(), {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}, compiled["batch"],
                  compiled["seq"])
    gib = 2 ** 30
    state = p.params_gb * gib + p.optimizer_gb * gib + 4  # + the int32 step
    assert compiled["state_bytes"] == state
    assert compiled["memory"]["argument"] == state + compiled["batch_bytes"], compiled["memory"]
    # tokens, segment ids, positions [1, 1, 40] and Engram rows [1, 1, 40, 2, 6] on each device, int32
    assert compiled["batch_bytes"] == 4 * 40 * (3 + 2 * 6)
    assert compiled["memory"]["alias"] == state  # the donated state is updated in place


HLO = """\
HloModule jit_step, entry_computation_layout={(f32[2,16]{1,0})->f32[8,16]{1,0}}

FileNames
1 "/src/dsv41_jax/model/moe.py"

FunctionNames
1 "body"

FileLocations
1 {file_name_id=1 function_name_id=1 line=191 end_line=191 column=4 end_column=4}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main.1 (param: f32[2,16]) -> f32[8,16] {
  %param = f32[2,16]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %x = bf16[2,16]{1,0} convert(%param)
  %all-gather.1 = f32[8,16]{1,0} all-gather(%param), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, \
metadata={op_name="jit(step)/while/body/closed_call/shard_map/all_gather" stack_frame_id=1}
  %all-gather.2 = f32[8,16]{1,0} all-gather(%param), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, \
metadata={op_name="jit(step)/while/body/closed_call/shard_map/all_gather" stack_frame_id=1}
  %all-reduce.3 = (f32[2,16]{1,0}, /*index=1*/bf16[2,16]{1,0}) all-reduce(%param, %x), replica_groups={{0,1},{2,3}}
  %reduce-scatter.4 = bf16[1,16]{1,0} reduce-scatter(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}
  %all-to-all.5 = s8[2,16]{1,0} all-to-all(%y), replica_groups={}
  ROOT %collective-permute.6 = f32[2,16]{1,0} collective-permute(%param), source_target_pairs={{0,1},{1,0}}
}
"""


def test_collectives_are_read_exactly_from_hlo_text():
    from dsv41_jax.train.hlo import collectives

    rows = {r.kind: r for r in collectives(HLO, n_devices=4)}
    ag = rows["all-gather"]  # two identical instructions: one row, counted twice
    assert (ag.operands, ag.result, ag.bytes, ag.group, ag.count) == (("f32[2,16]",), ("f32[8,16]",), 128, 4, 2)
    assert ag.source == "model/moe.py:191 (shard_map/all_gather)"
    ar = rows["all-reduce"]  # operands by name, the /*index=*/ mark ignored; 2·16·(4 + 2) bytes
    assert (ar.operands, ar.bytes, ar.group) == (("f32[2,16]", "bf16[2,16]"), 192, 2)
    assert (rows["reduce-scatter"].bytes, rows["reduce-scatter"].group) == (64, 2)  # the mesh form: axis_1 = 2
    assert rows["all-to-all"].group == 4 and rows["all-to-all"].operands == ()  # {} = every device; %y unknown
    assert rows["collective-permute"].group == 2


def test_largest_arrays_skip_fusion_bodies_and_group_repeats():
    from dsv41_jax.train.hlo import largest_arrays

    hlo = HLO + """
%fused_computation.7 (p: f32[2,16]) -> f32[64,16] {
  %p = f32[2,16]{1,0} parameter(0)
  ROOT %b = f32[64,16]{1,0} broadcast(%p), dimensions={0,1}
}
"""
    rows = largest_arrays(hlo, 2)
    assert [(r.type, r.bytes, r.op, r.count) for r in rows] == [("f32[8,16]", 512, "all-gather", 2),
                                                                 ("f32[2,16]", 128, "collective-permute", 1)]
