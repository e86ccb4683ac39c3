"""Generate from a training run, a converted (Orbax) or a release-format checkpoint, streaming the text.

    python infer/generate.py --run runs/pretrain_tiny --prompt "def " --temperature 0.8 --top-p 0.95
    python infer/generate.py --hf-dir tests/data/golden/tiny_hf --ids 0,17,42 --max-new-tokens 8 --dtype float32

The flow: load the model and its Engram hasher (``train.checkpoint.model_from_run``,
``checkpoint.load.model_from_orbax`` or ``model_from_hf``) -> tokenise the prompts (or take token ids) ->
``engine.sampling.Generator``: chunked exact or CED prefill into the packed cache, then compiled decode blocks
with Engram rows hashed on the device -> print each block's text as it finishes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer

from dsv41_jax.checkpoint.load import model_from_hf, model_from_orbax
from dsv41_jax.config import ConfigError
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.train.checkpoint import model_from_run


def load(args: argparse.Namespace):
    """(model, Engram hasher, tokenizer) from whichever checkpoint the arguments name."""
    if args.run:
        model, hasher, tok_path, step = model_from_run(args.run, dtype=args.dtype)
        print(f"sampling from {args.run} step {step}", flush=True)
    elif args.ckpt:
        model, hasher = model_from_orbax(args.ckpt, dtype=args.dtype)
        tok_path = Path(args.ckpt) / "tokenizer.json"
    else:
        model, hasher = model_from_hf(args.hf_dir, dtype=args.dtype)
        tok_path = Path(args.hf_dir) / "tokenizer.json"
    return model, hasher, Tokenizer.from_file(str(tok_path))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a training run directory: its newest good step, saved config and tokenizer")
    src.add_argument("--ckpt", help="an Orbax checkpoint written by `dsv41 convert`")
    src.add_argument("--hf-dir", help="a release-format Hugging Face directory")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="text prompt (repeat for a batch)")
    prompts.add_argument("--ids", action="append", help="comma-separated token ids (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-mode", default="exact", choices=["exact", "ced"])
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--show-ids", action="store_true", help="also print each row's generated token ids")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, hasher, tok = load(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = model.cfg
    if args.ids:
        prompts = [[int(t) for t in p.split(",")] for p in args.ids]
    else:
        prompts = [[cfg.bos_token_id, *tok.encode(p, add_special_tokens=False).ids] for p in args.prompt]
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, stop_tokens=(cfg.eos_token_id,),
                              prefill_mode=args.prefill_mode, prefill_chunk=args.prefill_chunk)
    gen = Generator(model, device_engram(hasher), len(prompts), args.max_seq_len, sampling)
    outs: list[list[int]] = [[] for _ in prompts]
    for block in gen.stream(prompts, seed=args.seed):  # [B, block] new ids; -1 once a row has stopped
        for i, row in enumerate(block):
            new = [int(t) for t in row if t >= 0]
            outs[i] += new
            if new:
                print(f"[{i}] {tok.decode(new, skip_special_tokens=False)}", flush=True)
    if args.show_ids:
        for i, ids in enumerate(outs):
            print(f"[{i}] ids {','.join(map(str, ids))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
