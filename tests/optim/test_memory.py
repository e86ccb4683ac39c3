"""Optimizer-state bytes per group, for the release config through ``jax.eval_shape`` (no memory)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.model.moe import RouterBias
from dsv41_jax.optim import OptimConfig, format_memory_table, optimizer, optimizer_memory
from dsv41_jax.optim import labels as L

BUFFERS = {L.ADAMW: 2, L.ADAMW_NO_DECAY: 2, L.NOT_OPTIMIZED: 0}  # every other group keeps one buffer
COUNTER_BYTES = {L.ADAMW: 8, L.ADAMW_NO_DECAY: 8, L.NOT_OPTIMIZED: 0}  # Adam's and the schedule's int32 counts


def test_release_state_bytes_per_group(release_model):
    _, params, _ = nnx.split(release_model, nnx.Any(nnx.Param, RouterBias), ...)
    rows = optimizer_memory(C.v41_flash(), params=params)
    print("\n" + format_memory_table(rows))
    for r in rows:
        want = BUFFERS.get(r.label, 1) * r.params * 4 + COUNTER_BYTES.get(r.label, 4)
        assert r.state_bytes == want, r
    by = {r.label: r for r in rows}
    assert by[L.SINKHORN_ENGRAM].params == 196_613_849_600  # the tables: one fp32 buffer, 786 GB
    assert sum(r.params for r in rows) == 748_494_684_784


def test_bf16_state_halves_the_momenta(tiny_cfg, tiny_params):
    """``state_dtype`` sets every momentum buffer; Adam's second moment stays fp32 (its groups are ~0.6 M)."""
    bf16 = optimizer_memory(tiny_cfg, OptimConfig(state_dtype="bfloat16"), params=tiny_params)
    for r in bf16:
        per_param = {L.ADAMW: 2 + 4, L.ADAMW_NO_DECAY: 2 + 4, L.NOT_OPTIMIZED: 0}.get(r.label, 2)
        assert r.state_bytes == per_param * r.params + COUNTER_BYTES.get(r.label, 4), r


def test_accounting_equals_what_init_allocates(tiny_cfg, tiny_params):
    concrete = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tiny_params)
    state = jax.jit(optimizer(tiny_cfg).init)(concrete)
    allocated = sum(x.nbytes for x in jax.tree.leaves(state))
    assert allocated == sum(r.state_bytes for r in optimizer_memory(tiny_cfg, params=tiny_params))
