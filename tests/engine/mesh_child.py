"""The multi-device half of ``test_sampling_mesh.py`` (run with 8 fake CPU devices).

Greedy generation from the golden checkpoint with the weights sharded over a mesh (experts over ``expert``)
and MoE layers expert-parallel; prints one JSON line per mesh with the generated tokens and the reference's.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from dsv41_jax.checkpoint.load import model_from_hf
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.testing import GOLDEN
from dsv41_jax.train.step import build_mesh


def main():
    model, hasher = model_from_hf(GOLDEN / "tiny_hf")
    ids = np.load(GOLDEN / "inputs.npz")["batch2_ids"]
    ref = np.load(GOLDEN / "ref_fp32.npz")
    want = np.concatenate([ref["batch2_decode_input_ids"], ref["batch2_decode_next_ids"][:, -1:]], axis=1)[:, :8]
    sampling = SamplingConfig(temperature=0, max_new_tokens=8, stop_tokens=(), block=4, prefill_chunk=64)
    for shape in ((1, 1, 2, 1),):
        mesh = build_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])
        gen = Generator(model, device_engram(hasher), 2, 256, sampling, mesh=mesh)
        state = gen.prefill([list(r) for r in ids])
        spec = state.cache.rings[0][0].sharding.spec
        got = gen.generate([list(r) for r in ids])
        expert_w = gen.state["layers"][2]["ffn"]["experts"]["w1"]["weight"][...]
        print(json.dumps({"mesh": shape, "tokens": got, "want": want.tolist(), "cache_spec": str(spec),
                          "expert_shards": len({str(s.index) for s in expert_w.addressable_shards})}))


if __name__ == "__main__":
    main()
