"""Train-step throughput (tokens/s, MFU) and multi-device equality on accelerators.

    python benchmarks/train_bench.py throughput CONFIG --meshes 1x1x1x1,2x1x1x1,1x1x2x1 [--seq 8192]
        [--batch-per-device 1] [--accum 1] [--experts N] [--remat none] [--steps 5] [--set KEY=VALUE ...]
    python benchmarks/train_bench.py equal CONFIG --meshes 1x1x1x1,2x1x1x1,1x1x2x1 [--seq 256] [--batch 2]

Meshes are data×fsdp×expert×tensor. ``throughput`` draws random weights on the devices, already sharded
(no host copy; ``engine_bench.build``), and times the jitted step on random tokens: median of ``--steps``
after two warm-ups. MFU counts model FLOPs (6 × active matmul parameters per token, plus attention over the
keys each query really reads and the indexer's scans, × 3 for forward and backward) against the H200's
989 TFLOP/s dense bf16 peak. ``--accum N`` accumulates N micro-batches per optimizer step (tokens per step = N ×
batch × seq); ``--set`` overrides config keys as ``dsv41 train`` does (``model.scan_layers=false``,
``model.moe.grouped_matmul=xla``, ``optim.ns_dtype=float32``: the previous forms, for a baseline in the same
run). ``--triton-attention on|off``: ``kernel_backend: pallas`` with the Triton sparse attention kernels
(``sparse_attention.api.TRITON_FORWARD`` / ``TRITON_BACKWARD``, on by default) on or off. ``compile_s`` is
tracing, lowering and compiling the step. ``--timing-lock FILE``: the warm-ups and timed steps hold an
exclusive lock on FILE, so that several processes (a baseline and a variant) can compile at once and still time
the device alone. ``equal`` runs one fp32 step from the same eager initial state and batch on every mesh and
prints loss and gradient norm (the first mesh is the baseline). One JSON line per result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.train.config import load
from dsv41_jax.train.step import (
    TrainState,
    batch_sharding,
    build_mesh,
    init_state,
    make_train_step,
    split_model,
    state_shardings,
)

PEAK_BF16 = 989e12  # H200 SXM dense bf16


def parse_mesh(text: str) -> tuple[int, ...]:
    shape = tuple(int(x) for x in text.split("x"))
    if len(shape) != 4:
        raise SystemExit(f"mesh {text!r}: give data x fsdp x expert x tensor, e.g. 1x1x2x1")
    return shape


def random_batch(cfg, batch: int, seq: int, seed: int = 0, accum: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    e = cfg.engram
    rows = np.stack([rng.integers(0, n, (accum, batch, seq, e.n_columns)) for n in e.num_embeddings], 3)
    return {"tokens": rng.integers(0, cfg.vocab_size, (accum, batch, seq)).astype(np.int32),
            "segment_ids": np.ones((accum, batch, seq), np.int32), "engram_rows": rows.astype(np.int32)}


def model_flops_per_token(cfg, seq: int) -> dict:
    from dsv41_jax.train.preflight import model_flops_per_token as flops

    total, active = flops(cfg, seq)
    return {"total": total, "active_params": active}


def device_state(model_cfg, ocfg, mesh, remat: str):
    """TrainState drawn on the devices, sharded by the table, and the jitted step (large models: no host copy)."""
    from engine_bench import build
    from flax import nnx

    from dsv41_jax.optim import optimizer

    graphdef, state = build(model_cfg, mesh)
    model = nnx.merge(graphdef, state)
    tx = optimizer(model_cfg, ocfg)
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    _, params, biases, _ = split_model(model)
    opt = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    ts = TrainState(jnp.zeros((), jnp.int32), params, biases, opt)
    step = jax.jit(make_train_step(graphdef, rest, model_cfg, ocfg, tx, remat, mesh),
                   in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, None),
                   donate_argnums=0)
    return ts, step


@contextlib.contextmanager
def timing_lock(path: str | None):
    """An exclusive lock on ``path`` (none without one) around the timed steps: benchmark processes sharing a
    device compile side by side (compiling is host work) and take the device one at a time."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def throughput(args, cfg):
    model_cfg = cfg.model
    if args.experts:
        model_cfg = model_cfg.replace(moe=dataclasses.replace(model_cfg.moe, n_routed_experts=args.experts))
    flops = model_flops_per_token(model_cfg, args.seq)
    base = None
    for text in args.meshes.split(","):
        shape = parse_mesh(text)
        n_dev = math.prod(shape)
        mesh = build_mesh(shape, devices=jax.devices()[:n_dev])
        batch = args.batch_per_device * shape[0] * shape[1] * shape[2]
        row = {"bench": "train_step", "mesh": text, "devices": n_dev, "seq": args.seq, "global_batch": batch,
               "accum": args.accum, "experts": model_cfg.moe.n_routed_experts, "remat": args.remat,
               "set": args.set}
        try:
            ts, step = device_state(model_cfg, cfg.optim, mesh, args.remat)
            n_params = sum(x.size for x in jax.tree.leaves(ts.params))
            data = jax.device_put(random_batch(model_cfg, batch, args.seq, accum=args.accum), batch_sharding(mesh))
            t0 = time.perf_counter()
            compiled = step.lower(ts, data).compile()
            row["compile_s"] = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            if mem is not None:
                row["device_GB"] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / 2**30
            with timing_lock(args.timing_lock):
                for _ in range(2):
                    ts, metrics = compiled(ts, data)
                jax.block_until_ready(ts)
                times = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    ts, metrics = compiled(ts, data)
                    jax.block_until_ready(ts)
                    times.append(time.perf_counter() - t)
            if args.profile:
                from profile_split import record

                box = [ts]

                def run(box=box, compiled=compiled, data=data):
                    box[0], _ = compiled(box[0], data)
                    return box[0]

                record(args.profile, compiled, run)
                ts = box[0]
            sec = float(np.median(times))
            tok_s = args.accum * batch * args.seq / sec
            row |= {"params_B": n_params / 1e9, "step_s": sec, "tokens_per_s": tok_s,
                    "tokens_per_s_per_device": tok_s / n_dev, "loss": float(metrics["loss"]),
                    "mfu": tok_s * flops["total"] / (n_dev * PEAK_BF16),
                    "peak_GB": max(d.memory_stats().get("peak_bytes_in_use", 0) for d in mesh.devices.flat) / 2**30
                    if mesh.devices.flat[0].platform != "cpu" else None}
            base = base or row
            row["speedup_vs_first"] = tok_s / base["tokens_per_s"]
            del ts, data, compiled, step
        except Exception as err:  # noqa: BLE001 -- an out-of-memory configuration is a result, not a crash
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(json.dumps(row | {"flops_per_token": flops}), flush=True)


def equal(args, cfg):
    model_cfg = cfg.model.replace(dtype="float32")
    first = None
    for text in args.meshes.split(","):
        shape = parse_mesh(text)
        mesh = build_mesh(shape, devices=jax.devices()[: math.prod(shape)])
        state, step, _ = init_state(model_cfg, cfg.optim, mesh, cfg.seed)
        data = jax.device_put(random_batch(model_cfg, args.batch, args.seq, seed=1), batch_sharding(mesh))
        _, m = step(state, data)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        first = first or m
        print(json.dumps({"bench": "train_step_equal", "mesh": text, "loss": m["loss"], "grad_norm": m["grad_norm"],
                          "loss_rel_diff": abs(m["loss"] - first["loss"]) / abs(first["loss"]),
                          "grad_norm_rel_diff": abs(m["grad_norm"] - first["grad_norm"]) / first["grad_norm"]}),
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["throughput", "equal"])
    p.add_argument("config")
    p.add_argument("--meshes", default="1x1x1x1")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch-per-device", type=int, default=1)
    p.add_argument("--accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    p.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--remat", default="none")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timing-lock", default=None,
                   help="a file to hold locked while timing: processes compiling side by side time one at a time")
    p.add_argument("--profile", default=None, help="directory for a trace of two steps and the step's HLO")
    p.add_argument("--triton-attention", choices=["on", "off"], default=None,
                   help="kernel_backend pallas with the Triton sparse attention below 64 heads switched on (the "
                        "default) or off (the Mosaic forward and the XLA backward: the previous pallas path)")
    args = p.parse_args()
    if args.triton_attention is not None:
        from pallas_kernels.sparse_attention import api as sparse_api

        sparse_api.TRITON_FORWARD = sparse_api.TRITON_BACKWARD = args.triton_attention == "on"
        args.set = [*args.set, "model.attention.kernel_backend=pallas"]
    cfg = load(args.config, args.set)
    args.seq = args.seq or cfg.data.seq_len
    print(json.dumps({"device": str(jax.devices()[0]), "n_devices": jax.device_count(), "jax": jax.__version__,
                      "config": args.config, "kernel_backend": cfg.model.attention.kernel_backend,
                      "triton_attention": args.triton_attention}), flush=True)
    (throughput if args.what == "throughput" else equal)(args, cfg)


if __name__ == "__main__":
    main()
