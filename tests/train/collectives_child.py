"""The 8-device half of ``test_collectives.py``: run with 8 fake CPU devices (``run_on_fake_cpus``).

Compiles (never runs) one train step of a tiny variant on a data × fsdp × expert = 2 × 2 × 2 mesh from shapes
alone and prints one JSON line: the collectives of the compiled program and the shapes the test looks for.
The variant widens the attention latent to 96 lanes (model width 64) and uses 40 tokens per row, so that
main KV, index keys and index scores have shapes no other array of the step has.
"""

from __future__ import annotations

import dataclasses
import json

import jax

from dsv41_jax import config as C
from dsv41_jax.optim import OptimConfig
from dsv41_jax.train.aot import lower_and_compile
from dsv41_jax.train.hlo import collectives
from dsv41_jax.train.step import build_mesh

B, S = 8, 40


def main():
    assert jax.device_count() == 8, jax.devices()
    tiny = C.tiny()
    cfg = tiny.replace(dtype="float32", attention=dataclasses.replace(tiny.attention, head_dim=96,
                                                                       index_head_dim=96))
    report = lower_and_compile(cfg, OptimConfig(), build_mesh((2, 2, 2, 1)), batch=B, seq=S, log=lambda _: None)
    rows = [r._asdict() for r in collectives(report.hlo, jax.device_count())]
    a = cfg.attention
    print(json.dumps({"rows": rows, "batch": B, "local_batch": B // 8, "seq": S, "head_dim": a.head_dim,
                      "index_head_dim": a.index_head_dim, "topk": a.index_topk,
                      "ratios": sorted({r for r in a.compress_ratios if r}),
                      "candidate_blocks": -(-S // a.candidate_block_size), "experts": cfg.moe.n_routed_experts,
                      "memory": report.memory, "state_bytes": report.state_bytes,
                      "batch_bytes": report.batch_bytes}))


if __name__ == "__main__":
    main()
