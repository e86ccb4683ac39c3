"""Pre-train from one YAML run config: the one library call behind ``dsv41 train``.

    python train/pretrain.py configs/pretrain_tiny.yaml [key=value ...]
    python train/pretrain.py configs/v41_flash_pretrain.yaml --preflight --devices 64

The call is ``train.loop.launch``: the strict run config (``train.config.load``, dotted ``key=value``
overrides) -> optionally a preflight that plans the mesh and per-device memory from shapes alone ->
``jax.distributed`` when several processes are configured -> ``train.loop.train``, which builds the mesh, the
tokenizer and the packed data, initialises the sharded state or resumes it from the newest good checkpoint,
runs the jitted steps and writes metrics and Orbax checkpoints under ``checkpoint.dir``.

Post-training uses this same launcher. A run config with a ``posttrain:`` section (``configs/qat_tiny.yaml``:
FP4-cache QAT and replay-aware fine-tuning, docs/posttraining.md) starts from ``posttrain.init_from`` and
trains on its SFT pairs plus the LM objective; config, mesh, resuming and checkpoints work exactly as above,
so there is no separate fine-tuning script:

    python train/pretrain.py configs/qat_tiny.yaml "posttrain.sft.paths=[pairs.jsonl]"   # from runs/pretrain_tiny
"""

from __future__ import annotations

import argparse
import sys

from dsv41_jax.config import ConfigError
from dsv41_jax.train.loop import launch


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
    try:  # the same call as `dsv41 train` (its --aot / --collectives are launch(aot=..., collectives=...))
        launch(args.config, args.overrides, stop_after=args.stop_after, preflight_only=args.preflight,
               devices=args.devices)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
