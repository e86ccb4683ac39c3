"""The ``dsv41`` command: thin wrappers over library functions.

Each subcommand lives in a small ``_cmd_*`` function; ``--config`` accepts a preset name (``tiny``,
``v41_flash``), one of our YAML files, or a Hugging Face directory / ``config.json``.
"""

from __future__ import annotations

import argparse
import sys

from dsv41_jax import cli_args as A
from dsv41_jax import compile_cache
from dsv41_jax import config as C
from dsv41_jax.checkpoint.plan import ConvertError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv41-jax")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def resolve_config(spec: str) -> C.ModelConfig:
    from dsv41_jax.config.files import config_path

    path = config_path(spec)
    if spec in C.PRESETS:
        return C.get_preset(spec)
    if path.is_dir() or path.name == "config.json":
        return C.from_hf(path)
    if path.suffix in (".yaml", ".yml"):
        data = C.read_yaml(path)  # a model config, or a run config's model section
        return C.load_yaml(path, section="model" if isinstance(data, dict) and "model" in data else None)
    raise C.ConfigError(f"--config {spec!r}: not a preset ({', '.join(C.PRESETS)}), YAML file or HF directory")


_PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def _precision(text: str) -> str:
    """``fp32`` / ``bf16`` (or the dtype names) -> the activation dtype name."""
    if text not in _PRECISIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of fp32, bf16 (or float32, bfloat16)")
    return _PRECISIONS[text]


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
    from dsv41_jax.scoring import ScoreInputError, score

    try:
        score(ckpt=args.ckpt, hf_dir=args.hf_dir, inputs=args.inputs, ids=args.ids, out=args.out,
              reference=args.reference, dtype=args.dtype, param_dtype=args.param_dtype, as_json=args.json,
              mesh=args.mesh)
    except ScoreInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


_WEIGHTS = {"native": "FP8 / FP4 weights and E8M0 scales kept as stored, the release's 510 GB",
            "bf16": "dequantised to bfloat16, about 1.5 TB for the release",
            "fp32": "dequantised to float32, about 3 TB for the release"}


def _cmd_convert(args) -> int:
    """HF release directory -> Orbax checkpoint (validated, streamed, resumable)."""
    from dsv41_jax.checkpoint.convert import convert, parse_mesh

    if not args.quiet:
        print(f"convert: --weights {args.weights} ({_WEIGHTS[args.weights]})", file=sys.stderr)
    convert(args.hf_dir, args.out, weights=args.weights, mesh=parse_mesh(args.mesh),
            chunk_bytes=int(args.chunk_mb * (1 << 20)), progress=not args.quiet)
    return 0


def _cmd_export(args) -> int:
    """Orbax checkpoint or training run -> the release's Hugging Face format (the inverse of convert)."""
    from dsv41_jax.checkpoint.export import export

    export(args.out, ckpt=args.ckpt, run=args.run, base=args.base, weights=args.weights,
           chunk_bytes=int(args.chunk_mb * (1 << 20)),
           shard_bytes=int(args.shard_gb * (1 << 30)), progress=not args.quiet)
    return 0


def _cmd_plot(args) -> int:
    """A run's loss / lr / throughput / expert-imbalance curves as PNG files."""
    from dsv41_jax.train.plot import plot_run

    for name, path in plot_run(args.run, args.out).items():
        print(f"{name}: {path}")
    return 0


def _cmd_make_fake_hf(args) -> int:
    """A random checkpoint of any config in the exact release format."""
    from dsv41_jax.checkpoint.fake_hf import write_fake_hf

    cfg = write_fake_hf(resolve_config(args.config), args.out, seed=args.seed,
                        shard_bytes=int(args.shard_mb * (1 << 20)), overwrite=args.overwrite)
    print(f"wrote a random {cfg.n_layers}-layer release-format checkpoint to {args.out}")
    return 0


def _cmd_ledger(args) -> int:
    """Cache bytes from the cache arrays themselves (abstract shapes; spec attention §7.5, §9.5)."""
    from dsv41_jax.cache import ledger

    cfg = resolve_config(args.config)
    led = ledger(cfg)
    for k, v in led.items():
        print(f"{k:48s} {v:>14,.1f}")
    per_token, swa = led["global_kv_bytes_per_token"], led["swa_bytes_per_sequence"]
    v4_flash = 3514  # V4-Flash global KV bytes per token (spec attention §7.5 context)
    print("\npersistent prefix cache for an N-token prefix (bounded replay keeps SWA state out of it):")
    print(f"{'N':>9s} {'global KV only':>16s} {'+ SWA state':>16s} {'V4-Flash global':>16s} {'ratio':>7s}")
    for n in (8192, 131072, 1048576):
        print(f"{n:9d} {per_token * n:16,.0f} {per_token * n + swa:16,.0f} {v4_flash * n:16,.0f} "
              f"{per_token / v4_flash:7.3f}")
    return 0


def _cmd_sample(args) -> int:
    """Generate from text or token-id prompts, streaming tokens as each compiled block finishes."""
    from dsv41_jax.sample import sample

    sample(run=args.run, ckpt=args.ckpt, hf_dir=args.hf_dir, prompts=args.prompt, ids=args.ids,
           max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, temperature=args.temperature,
           top_k=args.top_k, top_p=args.top_p, seed=args.seed, prefill_mode=args.prefill_mode,
           prefill_chunk=args.prefill_chunk, dtype=args.dtype, show_ids=args.show_ids, mesh=args.mesh,
           speculative=args.speculative, drafter=args.drafter, sps=args.sps,
           verify_widths=args.verify_widths, images=args.image)
    return 0


def _cmd_profile_sps(args) -> int:
    """Measure the target's verify steps per second by chunk width: the table of confidence-scheduled verify."""
    import json
    from pathlib import Path

    from dsv41_jax.checkpoint.load import load_model
    from dsv41_jax.engine.speculative import profile_sps, verify_widths
    from dsv41_jax.engram_device import device_engram

    loaded = load_model(run=args.run, ckpt=args.ckpt, hf_dir=args.hf_dir, dtype=args.dtype)
    drafts = args.drafts or loaded.model.cfg.dspark.block_size
    try:
        widths = verify_widths(drafts, True, args.verify_widths or ())
    except ValueError as err:
        raise C.ConfigError(f"--verify-widths: {err}") from None
    table = profile_sps(loaded.model, device_engram(loaded.hasher), args.batch, drafts, widths=widths,
                        context=args.context)
    Path(args.out).write_text(json.dumps(table, indent=1))
    for w, r in zip(table["widths"], table["steps_per_s"], strict=True):
        print(f"batch {args.batch} x {w} verify rows: {r:9.1f} steps/s")
    print(f"wrote {args.out} (dsv41 sample --speculative dspark --sps {args.out})")
    return 0


def _cmd_serve(args) -> int:
    """An OpenAI-compatible HTTP server (continuous batching, tiered prefix cache); needs the ``serve`` extra."""
    try:
        from dsv41_jax.serve import ServeOptions, serve
    except ImportError as err:
        raise C.ConfigError(f"dsv41 serve needs the serve extra: pip install 'dsv41-jax[serve]' ({err})") from None
    opts = ServeOptions(max_batch=args.max_batch, max_seq_len=args.max_seq_len, max_queue=args.max_queue,
                        prefill_mode=args.prefill_mode, prefill_chunk=args.prefill_chunk, block=args.block,
                        dtype=args.dtype, mesh=args.mesh, name=args.served_model_name,
                        prefix_cache_dir=args.prefix_cache_dir, host_cache_gb=args.host_cache_gb,
                        disk_cache_gb=args.disk_cache_gb, swa_pool_gb=args.swa_pool_gb, swa_ttl=args.swa_ttl,
                        allowed_local_media_path=args.allowed_local_media_path)
    serve(opts, host=args.host, port=args.port, run=args.run, ckpt=args.ckpt, hf_dir=args.hf_dir)
    return 0


def _cmd_train(args) -> int:
    """Pre-train from a YAML run config (resumes from the latest checkpoint in checkpoint.dir), or plan it; a
    config with a dspark_train section trains a DSpark drafter for a pre-trained run instead."""
    from dsv41_jax.config.files import config_path
    from dsv41_jax.train.dspark import is_dspark_config, train_dspark
    from dsv41_jax.train.loop import launch

    path = config_path(args.config)
    if path.is_file() and is_dspark_config(path):  # launch() names a missing file
        train_dspark(path, args.overrides)
        return 0
    launch(args.config, args.overrides, stop_after=args.stop_after, preflight_only=args.preflight, aot=args.aot,
           compile=not args.no_compile, collectives=args.collectives, devices=args.devices)
    return 0


def _cmd_eval_served(args) -> int:
    """The exact-vs-served gap of a run's latest checkpoint (or a converted / release one) on held-out
    prompt/response pairs."""
    from dsv41_jax.posttrain.evaluate import eval_run

    eval_run(args.data, args.boundaries, run=args.run, ckpt=args.ckpt, hf_dir=args.hf_dir, mesh=args.mesh,
             ablations=args.ablations, batch_size=args.batch_size, max_len=args.max_len, max_pairs=args.max_pairs,
             cut=args.cut, out=args.out)
    return 0


def _add_checkpoint_source(p: argparse.ArgumentParser, run: bool = False) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    if run:
        src.add_argument("--run", help="a `dsv41 train` run directory (checkpoint.dir): its newest good step, "
                         "saved config and tokenizer")
    src.add_argument("--ckpt", "--checkpoint", dest="ckpt", help="an Orbax checkpoint written by `dsv41 convert`")
    src.add_argument("--hf-dir", help="a release-format Hugging Face directory (config.json, index, shards, "
                     "tokenizer.json)")


def _add_mesh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", help="serve on many devices: auto, or AXIS=SIZE,... over data, fsdp, expert, tensor "
                   "(e.g. expert=8); a --ckpt is restored straight into its shards")


def _inspection_commands(sub) -> None:
    """The config's topology, parameter counts and KV-cache ledger."""
    p = sub.add_parser("topology", help="print the per-layer CSA2 topology of a config")
    p.add_argument("--config", default="v41_flash")
    p.set_defaults(fn=_cmd_topology)
    p = sub.add_parser("params", help="parameter counts of a config (abstract, no memory)")
    p.add_argument("--config", default="v41_flash")
    p.set_defaults(fn=_cmd_params)
    p = sub.add_parser("ledger", help="KV-cache bytes per token and per sequence of a config")
    p.add_argument("--config", default="v41_flash")
    p.set_defaults(fn=_cmd_ledger)


def _checkpoint_commands(sub) -> None:
    """Release checkpoints in and out: score, convert, export, a random one, a run's plots."""
    p = sub.add_parser("score", help="run a release-format HF checkpoint and compare with reference outputs")
    _add_checkpoint_source(p)
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"],
                   help="parameter dtype (default: float32 for --hf-dir and fp32 conversions, else bfloat16)")
    ids = p.add_mutually_exclusive_group(required=True)
    ids.add_argument("--inputs", help="npz with <tag>_ids int arrays [B, S] (writes golden-named arrays)")
    ids.add_argument("--ids", help="npy of int token ids [B, S]: --out gets teacher-forced fp32 logits [B, S, V]")
    p.add_argument("--reference", help="npz of reference outputs under the same names")
    p.add_argument("--out", help="write our outputs here (npz)")
    p.add_argument("--dtype", "--precision", dest="dtype", default="float32", type=_precision,
                   help="activation precision: fp32 (the exact reference semantics) or bf16")
    p.add_argument("--json", action="store_true")
    _add_mesh(p)
    p.set_defaults(fn=_cmd_score)
    p = sub.add_parser("convert", help="convert a release-format HF checkpoint into an Orbax checkpoint")
    p.add_argument("--hf-dir", required=True, help="directory with config.json, index, shards, tokenizer.json")
    p.add_argument("--out", required=True, help="new output directory (resumes from OUT.partial if present)")
    p.add_argument("--weights", default="native", choices=["native", "bf16", "fp32"],
                   help="native: keep FP8/FP4 + E8M0 scales (default); bf16/fp32: dequantise")
    p.add_argument("--mesh", help="align storage chunks to shards of this mesh, e.g. fsdp=8,expert=4")
    p.add_argument("--chunk-mb", type=A.above(0), default=256, help="output bytes per written band (memory bound)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(fn=_cmd_convert)
    p = sub.add_parser("export", help="write an Orbax checkpoint or a training run in the release's Hugging Face "
                       "format (names, FP8/FP4 dtypes, shards, index, config and tokenizer files)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", "--checkpoint", dest="ckpt", help="an Orbax checkpoint written by `dsv41 convert`")
    src.add_argument("--run", help="a `dsv41 train` run directory (its newest step)")
    p.add_argument("--out", required=True, help="new output directory")
    p.add_argument("--base", help="with --run: a `dsv41 convert` output for the DSpark / vision arrays and the "
                   "source scales (default: the run's posttrain.init_from when it is one)")
    p.add_argument("--weights", choices=["native", "bf16"], default="native",
                   help="native: the release's FP8 / FP4 tensors with E8M0 scales (default); bf16: every weight "
                   "dequantised to bfloat16, no scale tensors and no quantization_config (dsv41 convert reads both)")
    p.add_argument("--chunk-mb", type=A.above(0), default=256, help="float values read per band (memory bound)")
    p.add_argument("--shard-gb", type=A.above(0), default=5, help="shard size when the source has no index to follow")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(fn=_cmd_export)
    p = sub.add_parser("plot", help="a run's loss, lr, throughput and expert-imbalance curves as PNG (needs the "
                       "plot extra)")
    p.add_argument("run", help="a `dsv41 train` run directory (or its metrics.jsonl)")
    p.add_argument("--out", help="where the PNG files go (default: RUN/plots)")
    p.set_defaults(fn=_cmd_plot)
    p = sub.add_parser("make-fake-hf", help="write a random checkpoint of a config in the exact release format")
    p.add_argument("--config", required=True, help="preset name, YAML file or HF directory")
    p.add_argument("--out", required=True, help="a new or empty directory")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty --out")
    p.add_argument("--seed", type=A.at_least(0), default=0)
    p.add_argument("--shard-mb", type=A.above(0), default=64, help="target shard size")
    p.set_defaults(fn=_cmd_make_fake_hf)


def _generation_commands(sub) -> None:
    """Sampling, speculative decoding's table, the server and the served-path evaluation."""
    p = sub.add_parser("sample", help="generate from a training run, a converted (Orbax) or a release-format "
                       "checkpoint")
    _add_checkpoint_source(p, run=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", action="append", help="text prompt (repeat for a batch)")
    group.add_argument("--ids", action="append", type=A.token_ids,
                       help="comma-separated token ids (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=A.at_least(1), default=32)
    p.add_argument("--max-seq-len", type=A.at_least(2), default=4096, help="cache length: prompt + new tokens")
    p.add_argument("--temperature", type=A.at_least(0.0, float), default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=A.at_least(0), default=0, help="0: no top-k cut")
    p.add_argument("--top-p", type=A.probability, default=1.0, help="in (0, 1]; 1: no nucleus cut")
    p.add_argument("--seed", type=A.at_least(0), default=0)
    p.add_argument("--prefill-mode", default="exact", choices=["exact", "ced"])
    p.add_argument("--prefill-chunk", type=A.at_least(1), default=512)
    p.add_argument("--dtype", "--precision", dest="dtype", default="bfloat16", type=_precision,
                   help="activation precision: bf16 or fp32")
    p.add_argument("--show-ids", action="store_true", help="also print each row's generated token ids")
    p.add_argument("--speculative", type=A.speculative, metavar="dspark[:K]",
                   help="speculative decoding with the checkpoint's DSpark drafter, K drafts verified per step "
                   "(default its block size); prints the acceptance counts")
    p.add_argument("--drafter", help="with --speculative: a drafter.npz written by DSpark training (dsv41 train "
                   "--config configs/dspark_tiny.yaml) instead of the checkpoint's own mtp.* stages")
    p.add_argument("--sps", help="with --speculative: the table dsv41 profile-sps wrote; each step's verify lengths "
                   "are then chosen from the drafter's confidences (spec §8.4) instead of a fixed K")
    p.add_argument("--verify-widths", type=A.widths, metavar="W1,W2,...",
                   help="with --speculative: the verify chunk's compiled widths (rows per request, the widest K + 1; "
                   "default K + 1, and with --sps the widths the table was measured at)")
    p.add_argument("--image", action="append", help="an image file or data: URL for the next <image> of the "
                   "prompts (repeat, in order)")
    _add_mesh(p)
    p.set_defaults(fn=_cmd_sample)
    p = sub.add_parser("profile-sps", help="the target's speculative verify steps per second by chunk width (the "
                       "table of confidence-scheduled verification)")
    _add_checkpoint_source(p, run=True)
    p.add_argument("--batch", type=A.at_least(1), default=1)
    p.add_argument("--drafts", type=A.at_least(0), default=0, help="largest drafts per step (0: the block size)")
    p.add_argument("--context", type=A.at_least(1), default=256, help="tokens in the cache before the verify")
    p.add_argument("--verify-widths", type=A.widths, metavar="W1,W2,...",
                   help="the verify widths to compile and measure (rows per request, the widest drafts + 1; default "
                   "the powers of two below it and drafts + 1); sampling with the table compiles the same")
    p.add_argument("--dtype", "--precision", dest="dtype", default="bfloat16", type=_precision)
    p.add_argument("--out", default="sps.json")
    p.set_defaults(fn=_cmd_profile_sps)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching and a tiered "
                       "prefix cache (pip install 'dsv41-jax[serve]')")
    _add_checkpoint_source(p, run=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=A.at_least(0), default=8000)
    p.add_argument("--served-model-name", help="the model id of the API (default: the checkpoint directory's name)")
    p.add_argument("--max-batch", type=A.at_least(1), default=8, help="batch rows: requests decoded at once")
    p.add_argument("--max-seq-len", type=A.at_least(2), default=4096, help="cache length per row: prompt + output")
    p.add_argument("--max-queue", type=A.at_least(1), default=256, help="waiting requests beyond which 429 answers")
    p.add_argument("--prefill-mode", default="ced", choices=["exact", "ced"], help="prefill of a prefix-cache miss")
    p.add_argument("--prefill-chunk", type=A.at_least(1), default=512)
    p.add_argument("--block", type=A.at_least(1), default=8, help="decode steps per compiled block (requests "
                   "join and leave between blocks)")
    p.add_argument("--dtype", "--precision", dest="dtype", default="bfloat16", type=_precision)
    p.add_argument("--prefix-cache-dir", help="persist the prefix cache's global KV here (survives a restart)")
    p.add_argument("--host-cache-gb", type=A.at_least(0.0, float), default=8.0, help="host RAM tier budget")
    p.add_argument("--disk-cache-gb", type=A.at_least(0.0, float), default=256.0, help="disk tier budget")
    p.add_argument("--swa-pool-gb", type=A.at_least(0.0, float), default=2.0, help="SWA ring pool budget")
    p.add_argument("--swa-ttl", type=A.at_least(0.0, float), default=300.0, help="seconds a finished "
                   "conversation's SWA rings are kept (after that a hit replays the window)")
    p.add_argument("--allowed-local-media-path", metavar="DIR", help="image parts may name local files (a path or "
                   "file:// URL) inside DIR; without it only data: URLs are read")
    _add_mesh(p)
    p.set_defaults(fn=_cmd_serve)
    p = sub.add_parser("eval-served", help="gap between the exact forward and the served path (FP4 cache, CED, "
                       "bounded replay) on held-out prompt/response jsonl")
    _add_checkpoint_source(p, run=True)
    _add_mesh(p)
    p.add_argument("--data", required=True, action="append", help="jsonl of prompt/response pairs (repeatable)")
    p.add_argument("--boundaries", type=A.boundaries, default="cold",
                   help="cache-hit positions, comma-separated; cold = no hit")
    p.add_argument("--ablations", action="store_true", help="also each approximation alone (simulated path)")
    p.add_argument("--batch-size", type=A.at_least(1), default=8)
    p.add_argument("--max-len", type=A.at_least(2), default=256, help="tokens per conversation (longer ones are cut)")
    p.add_argument("--max-pairs", type=A.at_least(1), default=256)
    p.add_argument("--cut", type=A.at_least(0), help="CED cut layer (default: the engines' cut, candidate source + 1)")
    p.add_argument("--out", help="append one JSON line per table row here")
    p.set_defaults(fn=_cmd_eval_served)


def _training_commands(sub) -> None:
    """Pre-training from a run config."""
    p = sub.add_parser("train", help="pre-train from a YAML run config (model, optim, mesh, data, checkpoint)")
    p.add_argument("--config", required=True, help="run config: a YAML file, or a shipped one by name "
                   "(pretrain_tiny, qat_tiny, v41_flash_pretrain; configs/NAME.yaml works from any directory)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=1.0e-3")
    p.add_argument("--stop-after", type=A.at_least(1), help="stop after this many steps of this invocation (resumable)")
    p.add_argument("--preflight", action="store_true", help="print the mesh, per-device memory and model FLOPs "
                   "from shapes alone, then exit (nothing is allocated)")
    p.add_argument("--aot", action="store_true", help="also lower and compile the sharded train step from shapes "
                   "alone and print XLA's per-device memory next to the preflight, then exit")
    p.add_argument("--no-compile", action="store_true", help="with --aot: lower only (time it; no memory analysis)")
    p.add_argument("--collectives", action="store_true", help="compile the sharded step from shapes alone and print "
                   "its collectives (kind, types, bytes, group, where traced), then exit")
    p.add_argument("--devices", type=A.at_least(1), help="with --preflight / --aot / --collectives: plan for this "
                   "many devices (default: those present; for --aot / --collectives a count given here is made of "
                   "fake CPU devices)")
    p.set_defaults(fn=_cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in JAX")
    parser.add_argument("--version", action="version", version=f"dsv41-jax {_version()}")
    parser.add_argument("--compile-cache", metavar="DIR|off", help="JAX's persistent compilation cache (default: "
                        "$DSV41_COMPILE_CACHE, else ~/.cache/dsv41_jax/xla); off: none")
    sub = parser.add_subparsers(dest="command", required=True)
    _inspection_commands(sub)
    _checkpoint_commands(sub)
    _generation_commands(sub)
    _training_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Bad input is one ``error:`` line and exit code 2; a run that had to stop (``TrainingStopped``: a
    non-finite loss, a failed save) one line and exit code 1; a run preempted by SIGTERM, once its step is
    saved, one line and 143 (128 + SIGTERM, as if the signal had ended it: schedulers requeue on it)."""
    from dsv41_jax.train.guard import Preempted, TrainingStopped

    args = build_parser().parse_args(argv)
    compile_cache.enable(args.compile_cache)
    try:
        return args.fn(args)
    except (C.ConfigError, ConvertError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Preempted as err:
        print(str(err), file=sys.stderr)
        return 143
    except TrainingStopped as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
