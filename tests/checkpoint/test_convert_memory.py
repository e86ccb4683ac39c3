"""Streaming: converting a multi-shard mid-size checkpoint holds a few bands in memory, never the model.

Bound stated and tested (Python-heap allocations, which include every numpy buffer, via tracemalloc):
    peak ≤ 6 · chunk_bytes + 8 MiB
6 bands: the band being produced, its f32 decode and source rows, the stacked copy of an expert band, and
the band still being written; 8 MiB: the plan (one record per tensor) and Orbax's tree metadata. The fp32
output (~630 MiB) is ~57x that bound, and its largest single array (16 MiB) is bigger than the bound too;
measured: ~3.5 MiB.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import pytest

from dsv41_jax import config as C
from dsv41_jax.checkpoint.convert import convert
from dsv41_jax.checkpoint.fake_hf import write_fake_hf
from dsv41_jax.checkpoint.safetensors import ShardedCheckpoint

CHUNK = 512 << 10


def mid() -> C.ModelConfig:
    """Tiny's topology at 4x the width, 4x the experts, 8x their width (fp32 output ~630 MiB)."""
    t = C.tiny()
    return t.replace(dim=256, moe=dataclasses.replace(t.moe, n_routed_experts=32, moe_inter_dim=512))


@pytest.fixture(scope="module")
def mid_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("mid") / "hf"
    write_fake_hf(mid(), path, shard_bytes=8 << 20)
    return path


def test_peak_memory_is_a_few_bands(mid_hf, tmp_path):
    import orbax.checkpoint  # noqa: F401  (imports allocate; they are not the conversion's memory)
    import tokenizers  # noqa: F401

    assert len(ShardedCheckpoint(mid_hf).shards()) >= 8
    convert(mid_hf, tmp_path / "warm", weights="native", chunk_bytes=CHUNK, progress=False)  # lazy imports
    tracemalloc.start()
    try:
        result = convert(mid_hf, tmp_path / "fp32", weights="fp32", chunk_bytes=CHUNK, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = 6 * CHUNK + (8 << 20)
    largest = 32 * 512 * 256 * 4  # one layer's stacked w1 in fp32
    print(f"fp32 output {result.output_bytes / 2**20:.0f} MiB from {result.source_bytes / 2**20:.0f} MiB in "
          f"{result.seconds:.1f} s; peak traced {peak / 2**20:.2f} MiB (bound {bound / 2**20:.1f} MiB)")
    assert peak <= bound
    assert result.output_bytes > 50 * bound and largest > bound
