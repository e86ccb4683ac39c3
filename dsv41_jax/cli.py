"""The ``dsv41`` command: thin wrappers over library functions.

Each subcommand lives in a small ``_cmd_*`` function; ``--config`` accepts a preset name (``tiny``,
``v41_flash``), one of our YAML files, or a Hugging Face directory / ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsv41_jax import config as C


def resolve_config(spec: str) -> C.ModelConfig:
    path = Path(spec)
    if spec in C.PRESETS:
        return C.get_preset(spec)
    if path.is_dir() or path.name == "config.json":
        return C.from_hf(path)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
        return C.load_yaml(path, section="model" if "model" in data else None)
    raise C.ConfigError(f"--config {spec!r}: not a preset ({', '.join(C.PRESETS)}), YAML file or HF directory")


def _cmd_topology(args) -> int:
    from dsv41_jax.topology import describe

    print(describe(resolve_config(args.config)))
    return 0


def _cmd_params(args) -> int:
    """Parameter counts per top-level group, from abstract shapes (no memory is allocated)."""
    import math

    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.model.transformer import abstract_model

    model = abstract_model(resolve_config(args.config))
    groups: dict[str, int] = {}
    for name, var in flat_variables(model).items():
        group = ("engram tables" if name.endswith("engram.embed.weight") else
                 "routed experts" if ".ffn.experts." in name else "other")
        groups[group] = groups.get(group, 0) + math.prod(var.shape)
    backbone = groups.get("routed experts", 0) + groups.get("other", 0)
    rows = {"backbone (excl. Engram tables)": backbone, **groups}
    for k, v in rows.items():
        print(f"{k:32s} {v / 1e9:10.4f} B")
    return 0


def _cmd_score(args) -> int:
    """Run a release-format checkpoint on token ids; write golden-named arrays; compare with a reference."""
    import numpy as np

    from dsv41_jax.checkpoint.load import model_from_hf
    from dsv41_jax.scoring import compare, format_report, prefill_outputs

    model, hasher = model_from_hf(args.hf_dir, dtype=args.dtype)
    inputs = np.load(args.inputs)
    tags = [k[: -len("_ids")] for k in inputs.files if k.endswith("_ids")]
    if not tags:
        raise SystemExit(f"{args.inputs}: no '<tag>_ids' arrays found")
    ours = {}
    for tag in tags:
        ours |= prefill_outputs(model, hasher, inputs[f"{tag}_ids"], tag, layers_detail=tag == tags[0])
    if args.out:
        np.savez(args.out, **ours)
        print(f"wrote {len(ours)} arrays to {args.out}")
    if args.reference:
        report = compare(ours, dict(np.load(args.reference)))
        print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("topology", help="print the per-layer CSA2 topology of a config")
    p.add_argument("--config", default="v41_flash")
    p.set_defaults(fn=_cmd_topology)
    p = sub.add_parser("params", help="parameter counts of a config (abstract, no memory)")
    p.add_argument("--config", default="v41_flash")
    p.set_defaults(fn=_cmd_params)
    p = sub.add_parser("score", help="run a release-format HF checkpoint and compare with reference outputs")
    p.add_argument("--hf-dir", required=True, help="directory with config.json, index, shards, tokenizer.json")
    p.add_argument("--inputs", required=True, help="npz with <tag>_ids int arrays [B, S]")
    p.add_argument("--reference", help="npz of reference outputs under the same names")
    p.add_argument("--out", help="write our outputs here (npz)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
