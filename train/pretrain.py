"""Pre-train from one YAML run config: what ``dsv41 train`` does, as a short sequence of library calls.

    python train/pretrain.py configs/pretrain_tiny.yaml [key=value ...]
    python train/pretrain.py configs/v41_flash_pretrain.yaml --preflight --devices 64

The flow: the strict run config (``train.config.load``, dotted ``key=value`` overrides) -> optionally a
preflight that plans the mesh and per-device memory from shapes alone -> ``jax.distributed`` when several
processes are configured -> ``train.loop.train``, which builds the mesh, the tokenizer and the packed data,
initialises the sharded state or resumes it from the newest good checkpoint, runs the jitted steps and writes
metrics and Orbax checkpoints under ``checkpoint.dir``.

Post-training uses this same launcher. A run config with a ``posttrain:`` section (``configs/qat_tiny.yaml``:
FP4-cache QAT and replay-aware fine-tuning, docs/posttraining.md) starts from ``posttrain.init_from`` and
trains on its SFT pairs plus the LM objective; config, mesh, resuming and checkpoints work exactly as above,
so there is no separate fine-tuning script:

    python train/pretrain.py configs/qat_tiny.yaml "posttrain.sft.paths=[pairs.jsonl]"   # from runs/pretrain_tiny
"""

from __future__ import annotations

import argparse
import sys

import jax

from dsv41_jax.config import ConfigError
from dsv41_jax.train import distributed
from dsv41_jax.train.config import TrainConfig, load
from dsv41_jax.train.loop import train
from dsv41_jax.train.preflight import format_preflight, preflight

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def plan(cfg: TrainConfig, n_devices: int, source: str) -> str:
    """The preflight report for ``n_devices``: mesh, per-device bytes, model FLOPs (nothing is allocated)."""
    mesh = dict(zip(MESH_AXES, cfg.mesh.shape(n_devices, source), strict=True))
    return format_preflight(preflight(cfg.model, cfg.optim, mesh, cfg.data.batch_size, cfg.data.seq_len,
                                      cfg.remat, cfg.grad_accum))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run config, e.g. configs/pretrain_tiny.yaml or configs/qat_tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=1.0e-3")
    p.add_argument("--stop-after", type=int, help="stop after this many steps of this invocation (resumable)")
    p.add_argument("--preflight", action="store_true", help="print the mesh, per-device memory and model FLOPs "
                   "from shapes alone, then exit")
    p.add_argument("--devices", type=int, help="with --preflight: plan for this many devices (default: present)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        if args.preflight:
            print(plan(cfg, args.devices or jax.device_count(), args.config))
            return 0
        distributed.initialize(cfg.distributed)  # before anything touches a device
        train(cfg, source=args.config, stop_after=args.stop_after)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
