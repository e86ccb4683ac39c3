"""The bf16 train step's products: every one takes operands of one dtype, forward and backward.

An fp32 × bf16 product (autodiff's transpose of a bf16 product against its fp32 cotangent) is promoted to an
fp32 GEMM on GPU: on the H100 those were a third of ``configs/small.yaml``'s step. Traced only (no compile).
"""

import jax
import jax.numpy as jnp

from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.optim import OptimConfig, optimizer
from dsv41_jax.testing import mixed_products
from dsv41_jax.train.step import TrainState, make_train_step, split_model


def test_bf16_train_step_has_no_mixed_precision_products(tiny_cfg):
    cfg = tiny_cfg.replace(dtype="bfloat16", param_dtype="float32")
    ocfg = OptimConfig(indexer_kl_weight=0.5)  # the indexer's own loss differentiated too
    graphdef, params, biases, rest = split_model(abstract_model(cfg))
    tx = optimizer(cfg, ocfg)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, biases, jax.eval_shape(tx.init, params))
    a, b, s = 2, 1, 64
    n_engram = len(cfg.engram.layer_ids)
    batch = {"tokens": jax.ShapeDtypeStruct((a, b, s), jnp.int32),
             "segment_ids": jax.ShapeDtypeStruct((a, b, s), jnp.int32),
             "engram_rows": jax.ShapeDtypeStruct((a, b, s, n_engram, cfg.engram.n_columns), jnp.int32)}
    for remat in ("none", "block"):
        step = make_train_step(graphdef, rest, cfg, ocfg, tx, remat=remat)
        assert mixed_products(jax.make_jaxpr(step)(state, batch).jaxpr) == [], remat
