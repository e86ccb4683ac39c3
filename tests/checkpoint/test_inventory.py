"""The release inventory the converter expects, generated from the config alone (spec model §2.4, §2.7)."""

from __future__ import annotations

import collections
import dataclasses
import json
import struct

import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax.checkpoint.inventory import expected_inventory, inventory_bytes, structure_sha256
from dsv41_jax.checkpoint.plan import config_outputs
from dsv41_jax.checkpoint.tree import NON_BACKBONE_PREFIXES, flat_variables
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.testing import RELEASE

# spec model §2.7: what OpenTallas pins from the real shard headers ("shard_header_inventory")
RELEASE_SHA256 = "834a3fd1840230036c63b3edf4467d9356784f69bcc4a7fb156ffec536b8ef2c"


@pytest.fixture(scope="module")
def release():
    return expected_inventory(C.from_hf(RELEASE / "config.json"))


def test_release_counts_and_bytes(release):
    assert len(release) == 96_085
    assert len({t.name for t in release}) == 96_085
    assert sum(t.name.startswith("mtp.") for t in release) == 2_401
    assert inventory_bytes(release) == 510_286_023_000  # = the index's metadata.total_size (spec §2.1)


def test_release_structure_hash(release):
    # canonical JSON: records {dtype, name, shape, size_bytes} sorted by name, compact separators,
    # sorted keys, one trailing newline
    assert structure_sha256(release) == RELEASE_SHA256
    assert structure_sha256(list(reversed(release))) == RELEASE_SHA256  # order of generation is irrelevant


def test_release_composition_by_dtype(release):
    # spec model §2.1 composition (GiB): I8 259.45, all F8_E4M3 190.00, F8_E8M0 21.94, BF16 3.68, F32 0.158
    gib = collections.Counter()
    for t in release:
        gib[t.dtype] += t.nbytes / 2**30
    assert gib["I8"] == pytest.approx(259.45, abs=0.01)
    assert gib["F8_E4M3"] == pytest.approx(190.00, abs=0.01)
    assert gib["F8_E8M0"] == pytest.approx(21.94, abs=0.01)
    assert gib["BF16"] == pytest.approx(3.68, abs=0.01)
    assert gib["F32"] == pytest.approx(0.158, abs=0.001)


def test_any_structural_change_changes_the_hash(release):
    cfg = C.from_hf(RELEASE / "config.json")
    other = expected_inventory(cfg.replace(moe=dataclasses.replace(cfg.moe, moe_inter_dim=2048)))
    assert structure_sha256(other) != RELEASE_SHA256


def _headers(hf_dir) -> dict[str, tuple[str, tuple[int, ...]]]:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with open(hf_dir / shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out |= {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    return out


def test_tiny_inventory_is_the_golden_checkpoint(golden_dir):
    # the golden was written by the reference's own tooling: every name, dtype and shape must agree
    hf_dir = golden_dir / "tiny_hf"
    ours = {t.name: (t.dtype, t.shape) for t in expected_inventory(C.from_hf(hf_dir))}
    assert ours == _headers(hf_dir)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert inventory_bytes(expected_inventory(C.tiny())) == index["metadata"]["total_size"]


@pytest.mark.parametrize("mode", ["native", "fp32"])
def test_release_conversion_fits_the_release_model(mode):
    # every array the release model needs is produced with its exact shape, FP8 / FP4 / E8M0 bytes exactly
    # where the native model holds them; the rest of the outputs are the DSpark / vision subtrees
    outputs = {o.name: o for o in config_outputs(C.v41_flash(), mode)}
    model = abstract_model(C.v41_flash().replace(weight_format="native" if mode == "native" else "float"))
    variables = flat_variables(model)
    assert set(variables) <= set(outputs)
    extra = {n for n in set(outputs) - set(variables) if not n.startswith(NON_BACKBONE_PREFIXES)}
    assert extra == ({f"layers.{i}.attn.wo_a.scale" for i in range(40)} if mode == "native" else set())  # export's
    for name, var in variables.items():
        assert outputs[name].shape == tuple(var.shape), name
        assert (outputs[name].dtype.itemsize == 1) == (np.dtype(var.dtype).itemsize == 1), name
    if mode == "native":  # the stored bytes, except wo_a (40 layers + 3 stages) widened to bf16 beside its scale
        wo_a = 43 * 8192 * 4096 * (2 - 1)
        assert sum(o.nbytes for o in outputs.values()) == 510_286_023_000 + wo_a
