"""Parameter tree of the full release model, built abstractly (``nnx.eval_shape``: shapes only, no memory),
against the parameter counts of spec model §2.1 and the tensor inventory of spec model §2.4; and the tiny
model's tree against the golden checkpoint's index and shard headers."""

from __future__ import annotations

import json
import math
import re
import struct
import time

import jax
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.checkpoint.tree import NON_BACKBONE_PREFIXES, flat_variables
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.testing import GOLDEN

ENGRAM_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
ROUTED_EXPERTS = re.compile(r"^layers\.\d+\.ffn\.experts\.")


def _abstract_model(cfg: C.ModelConfig) -> nnx.Module:
    return abstract_model(cfg)


@pytest.fixture(scope="module")
def release_vars() -> dict[str, nnx.Variable]:
    start = time.perf_counter()
    model = _abstract_model(C.v41_flash())
    variables = flat_variables(model)
    print(f"abstract release model: {len(variables)} variables in {time.perf_counter() - start:.1f} s")
    return variables


def _shape(var: nnx.Variable) -> tuple[int, ...]:
    return tuple(var.get_value().shape)


def _count(variables, pattern=None, exclude=None) -> int:
    return sum(math.prod(_shape(v)) for n, v in variables.items()
               if (pattern is None or pattern.search(n)) and not (exclude and exclude.search(n)))


# ----------------------------------------------------------------------------------------------------
# release: no memory, counts


def test_release_tree_is_abstract(release_vars):
    leaves = [v.get_value() for v in release_vars.values()]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert not any(isinstance(x, jax.Array) for x in leaves)


def test_release_backbone_count(release_vars):
    # spec model §2.1: backbone (no Engram tables, vision or DSpark) 551.88 B
    assert _count(release_vars, exclude=ENGRAM_TABLE) == pytest.approx(551.88e9, abs=0.005e9)


def test_release_routed_expert_count(release_vars):
    # spec model §2.1: of which routed experts 543.58 B
    assert _count(release_vars, ROUTED_EXPERTS) == pytest.approx(543.58e9, abs=0.005e9)
    assert _count(release_vars, ROUTED_EXPERTS) == 40 * 384 * 3 * 2304 * 5120


def test_release_engram_table_count(release_vars):
    # spec model §2.1: Engram tables 196.61 B
    assert _count(release_vars, ENGRAM_TABLE) == pytest.approx(196.61e9, abs=0.005e9)
    assert _count(release_vars, ENGRAM_TABLE) == (384006168 + 384016682) * 256


# ----------------------------------------------------------------------------------------------------
# release: every name and shape against spec model §2.4


def release_inventory() -> dict[str, tuple[int, ...]]:
    """Backbone tensors of the release checkpoint (spec model §2.4 generator rules), in our naming.

    The numbers are the release's, written out here independently of the config code. Differences from the
    checkpoint's own names, all deliberate: routed experts are stacked into one [E, out, in] tensor per
    w1/w2/w3 and hold logical (unpacked FP4) widths; ``.scale`` tensors, ``mtp.*``, ``vision.*``,
    ``aligner.*`` and ``image_*`` are not part of the text backbone.
    """
    d, vocab, e, inter = 5120, 129280, 384, 2304
    kv_sources, index_sources, ratio2 = (2, 8, 14, 20), (2, 8, 14, 20, 24, 28, 32, 36), range(2, 20)
    engram_rows = {1: 384006168, 14: 384016682}
    inv = {"embed.weight": (vocab, d), "head.weight": (vocab, d), "norm.weight": (d,)}
    for layer in range(40):
        p = f"layers.{layer}."
        inv |= {
            p + "attn.attn_sink": (64,),
            p + "attn.q_norm.weight": (1280,),
            p + "attn.kv_norm.weight": (512,),
            p + "attn.wq_a.weight": (1280, d),
            p + "attn.wq_b.weight": (32768, 1280),
            p + "attn.wkv.weight": (512, d),
            p + "attn.wo_a.weight": (8192, 4096),
            p + "attn.wo_b.weight": (d, 8192),
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "ffn.gate.weight": (e, d),
            p + "ffn.gate.bias": (e,),
            p + "ffn.gate.bias_vl": (e,),
            p + "ffn.experts.w1.weight": (e, inter, d),
            p + "ffn.experts.w2.weight": (e, d, inter),
            p + "ffn.experts.w3.weight": (e, inter, d),
            p + "ffn.shared_experts.w1.weight": (inter, d),
            p + "ffn.shared_experts.w2.weight": (d, inter),
            p + "ffn.shared_experts.w3.weight": (inter, d),
        }
        for site in ("attn", "ffn"):
            inv |= {p + f"hc_{site}_fn": (24, 4 * d), p + f"hc_{site}_base": (24,), p + f"hc_{site}_scale": (3,)}
        if layer in kv_sources:
            inv |= {p + "attn.compressor.wkv.weight": (512, d), p + "attn.compressor.norm.weight": (512,),
                    p + "attn.indexer.wk.weight": (128, 512), p + "attn.indexer.k_norm.weight": (128,)}
            if layer in ratio2:
                inv[p + "attn.compressor.wgate.weight"] = (512, d)
        if layer in index_sources:
            inv |= {p + "attn.indexer.weights_proj.weight": (32, d), p + "attn.indexer.wq_b.weight": (4096, 1280)}
        if layer in engram_rows:
            inv |= {p + "engram.embed.weight": (engram_rows[layer], 256), p + "engram.q_weight": (4, d),
                    p + "engram.k_weight": (4, d), p + "engram.wkv.weight": (25600, 6144)}
    return inv


def test_inventory_generator_reproduces_spec_counts():
    # the generator itself agrees with the published totals, so a bug in it cannot mask one in the model
    inv = release_inventory()
    backbone = sum(math.prod(s) for n, s in inv.items() if not ENGRAM_TABLE.search(n))
    assert backbone == pytest.approx(551.88e9, abs=0.005e9)
    # spec §2.4 family counts (in checkpoint tensors, i.e. unstacked, with FP8/FP4 scales)
    unstacked = sum(384 if ".experts." in n else 1 for n in inv)
    fp8 = re.compile(r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|indexer\.wq_b\.weight$|shared_experts\.w\d\.weight$|"
                     r"engram\.(wkv|embed)\.weight$")
    scales = sum(1 for n in inv if fp8.search(n)) + sum(384 for n in inv if ".experts." in n)
    # 96,085 tensors in the checkpoint minus 2,401 under mtp. minus vision (32·8 + 3), aligner (4), image_* (3)
    assert unstacked + scales == 96085 - 2401 - (32 * 8 + 3) - 4 - 3


def test_release_names_match_inventory(release_vars):
    inv = release_inventory()
    ours = set(release_vars)
    assert not ours - set(inv), f"not in the release inventory: {sorted(ours - set(inv))[:20]}"
    assert not set(inv) - ours, f"missing from our tree: {sorted(set(inv) - ours)[:20]}"


def test_release_shapes_match_inventory(release_vars):
    inv = release_inventory()
    wrong = {n: (_shape(v), inv[n]) for n, v in release_vars.items() if n in inv and _shape(v) != inv[n]}
    assert not wrong


@pytest.mark.parametrize("suffix, layers", [
    ("attn.compressor.wkv.weight", [2, 8, 14, 20]),
    ("attn.compressor.wgate.weight", [2, 8, 14]),
    ("attn.indexer.wq_b.weight", [2, 8, 14, 20, 24, 28, 32, 36]),
    ("attn.indexer.wk.weight", [2, 8, 14, 20]),
    ("engram.embed.weight", [1, 14]),
])
def test_release_family_placement(release_vars, suffix, layers):
    # spec attention §1.2: 4 compressor.wkv, 3 wgate, 8 indexer.wq_b, 4 indexer.wk
    found = sorted(int(n.split(".")[1]) for n in release_vars if n.startswith("layers.") and n.endswith(suffix))
    assert found == layers


# ----------------------------------------------------------------------------------------------------
# tiny: names and shapes against the golden checkpoint


def _golden_index():
    path = GOLDEN / "tiny_hf" / "model.safetensors.index.json"
    if not path.exists():
        pytest.skip(f"golden checkpoint not found at {path.parent}")
    return path, json.loads(path.read_text())["weight_map"]


def _header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def golden_backbone_shapes() -> dict[str, tuple[int, ...]]:
    """Golden tensors in our naming: experts stacked [E, out, in] with FP4 columns unpacked, no scales."""
    index_path, weight_map = _golden_index()
    headers = {}
    for shard in sorted(set(weight_map.values())):
        headers |= _header(index_path.parent / shard)
    assert set(headers) == set(weight_map)
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, dict[int, tuple[int, ...]]] = {}
    for name, info in headers.items():
        if name.endswith(".scale") or name.startswith(NON_BACKBONE_PREFIXES):
            continue
        shape = tuple(info["shape"])
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(w\d\.weight)", name)
        if m:
            assert info["dtype"] == "I8"  # two E2M1 codes per byte
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = (shape[0], 2 * shape[1])
        else:
            shapes[name] = shape
    for name, per_expert in experts.items():
        assert sorted(per_expert) == list(range(len(per_expert))), name
        (one,) = set(per_expert.values())
        shapes[name] = (len(per_expert), *one)
    return shapes


@pytest.fixture(scope="module")
def tiny_vars() -> dict[str, nnx.Variable]:
    return flat_variables(_abstract_model(C.tiny()))


def test_tiny_names_match_golden_index(tiny_vars):
    _, weight_map = _golden_index()
    golden = {re.sub(r"\.experts\.\d+\.", ".experts.", n) for n in weight_map
              if not n.endswith(".scale") and not n.startswith(NON_BACKBONE_PREFIXES)}
    assert set(tiny_vars) == golden


def test_tiny_shapes_match_golden_headers(tiny_vars):
    golden = golden_backbone_shapes()
    assert set(golden) == set(tiny_vars)
    wrong = {n: (_shape(v), golden[n]) for n, v in tiny_vars.items() if _shape(v) != golden[n]}
    assert not wrong


def test_tiny_and_release_have_the_same_families(release_vars, tiny_vars):
    # the tiny model exercises every parameter family of the release (names with layer ids removed)
    def families(names):
        return {re.sub(r"^layers\.\d+\.", "layers.L.", n) for n in names}
    assert families(tiny_vars) == families(release_vars)
