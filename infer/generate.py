"""Generate from a training run, a converted (Orbax) or a release-format checkpoint, streaming the text.

    python infer/generate.py --run runs/pretrain_tiny --prompt "def " --temperature 0.8 --top-p 0.95
    python infer/generate.py --hf-dir tests/data/golden/tiny_hf --ids 0,17,42 --max-new-tokens 8 --dtype float32

The whole of it is one call, ``dsv41_jax.sample.sample``, the function behind ``dsv41 sample`` too. Its flow:
``checkpoint.load.load_model`` (the model, its Engram hasher and the tokenizer of the run or checkpoint
directory) -> the prompts tokenised after BOS (or taken as token ids) -> ``engine.sampling.Generator``:
chunked exact or CED prefill into the packed cache, then compiled decode blocks with Engram rows hashed on
the device -> each block's text printed as it finishes.
"""

from __future__ import annotations

import argparse
import sys

from dsv41_jax.config import ConfigError
from dsv41_jax.sample import parse_ids, sample


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a training run directory: its newest good step, saved config and tokenizer")
    src.add_argument("--ckpt", help="an Orbax checkpoint written by `dsv41 convert`")
    src.add_argument("--hf-dir", help="a release-format Hugging Face directory")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="text prompt (repeat for a batch)")
    prompts.add_argument("--ids", action="append", type=parse_ids, help="comma-separated token ids (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--show-ids", action="store_true", help="also print each row's generated token ids")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # the remaining knobs (top-k, CED prefill, max_seq_len, ...) are keyword arguments of sample()
        sample(run=args.run, ckpt=args.ckpt, hf_dir=args.hf_dir, prompts=args.prompt, ids=args.ids,
               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               seed=args.seed, dtype=args.dtype, show_ids=args.show_ids)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
