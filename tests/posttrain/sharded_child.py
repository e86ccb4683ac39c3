"""The 8-device half of ``test_posttrain_on_a_mesh.py``: one post-training step (SFT rows, replay at drawn hit
boundaries, CED, self-distillation, indexer KL) on data × fsdp × expert = 2 × 2 × 2 and on one device, from
the same state and batch. Prints one JSON line. Run with 8 fake CPU devices (``run_on_fake_cpus``)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from posttrain_testing import two_layer_model_dict

from dsv41_jax import config as C
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig, optimizer
from dsv41_jax.posttrain.config import DistillConfig, PosttrainConfig, ReplayConfig
from dsv41_jax.posttrain.step import make_posttrain_step
from dsv41_jax.train.step import TrainState, batch_sharding, build_mesh, split_model, state_shardings

B, S = 8, 40
MODEL = two_layer_model_dict()  # 8 experts, split over 2 on the mesh


def batch(cfg) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(24, S + 1, B)
    prompts = rng.integers(10, 20, B)
    seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    pos = np.arange(S)[None]
    mask = (pos >= prompts[:, None] - 1) & (pos < lengths[:, None] - 1)
    out = dict(tokens=(rng.integers(4, cfg.vocab_size, (B, S)) * seg).astype(np.int32), segment_ids=seg,
               prompt_len=prompts.astype(np.int32), loss_mask=mask.astype(np.float32))
    return {k: v[None] for k, v in out.items()}  # one micro-batch


def one_step(cfg, ocfg, pcfg, mesh, data):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tx = optimizer(cfg, ocfg)
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    _, params, biases, _ = split_model(model)
    state = jax.device_put(TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params)), shardings)
    step = jax.jit(make_posttrain_step(graphdef, rest, cfg, ocfg, tx, pcfg, seed=3, mesh=mesh),
                   in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, None))
    new, metrics = step(state, jax.device_put(data, batch_sharding(mesh)))
    return jax.device_get(new), {k: float(v) for k, v in jax.device_get(metrics).items()}


def main():
    assert jax.device_count() == 8, jax.devices()
    cfg = C.from_dict(MODEL)
    ocfg = OptimConfig(lr=2e-3, warmup_steps=2, constant_until=100, decay_until=200, total_steps=300,
                       adam_eps=1e-6, ns_dtype="float32", indexer_kl_weight=0.5)
    pcfg = PosttrainConfig(replay=ReplayConfig(prob=0.75), distill=DistillConfig(weight=10.0))
    data = batch(cfg)
    single, m1 = one_step(cfg, ocfg, pcfg, build_mesh((1, 1, 1, 1), devices=jax.devices()[:1]), data)
    sharded, m8 = one_step(cfg, ocfg, pcfg, build_mesh((2, 2, 2, 1)), data)
    params = max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(x)).max(), 1e-30))
                 for x, y in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params), strict=True))
    print(json.dumps({"single": m1, "sharded": m8, "params_rel": params}))


if __name__ == "__main__":
    main()
