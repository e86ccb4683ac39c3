r"""Convert a release-format checkpoint to Orbax, then score the converted model against reference outputs.

    python infer/convert_and_score.py --hf-dir tests/data/golden/tiny_hf --out /tmp/tiny_orbax \
        --inputs tests/data/golden/inputs.npz --reference tests/data/golden/ref_fp32.npz

One call, ``scoring.convert_and_score``: ``checkpoint.convert.convert`` (every tensor name, dtype and shape
checked against the inventory its config.json implies, then written band by band; an interrupted run resumes
from OUT.partial/, a finished OUT is scored as it is) -> ``scoring.score``, the function behind
``dsv41 score``: ``checkpoint.load.load_model`` -> the teacher-forced forward over each ``<tag>_ids`` array of
the inputs, keeping the logits and every discrete decision (top-k, candidates, expert routes, Engram rows)
under the reference's names -> ``scoring.compare`` against the reference, one line per array. Point --hf-dir
at a download of the real model to check it the same way.
"""

from __future__ import annotations

import argparse
import sys

from dsv41_jax.checkpoint.convert import ConvertError
from dsv41_jax.config import ConfigError
from dsv41_jax.scoring import ScoreInputError, convert_and_score


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="directory with config.json, index, shards, tokenizer.json")
    p.add_argument("--out", required=True, help="the Orbax checkpoint directory to write (or to score, if finished)")
    p.add_argument("--weights", default="fp32", choices=["native", "bf16", "fp32"],
                   help="native: keep FP8/FP4 + E8M0 scales; bf16/fp32: dequantise (default fp32)")
    p.add_argument("--inputs", required=True, help="npz with <tag>_ids int arrays [B, S]")
    p.add_argument("--reference", help="npz of reference outputs under the same names")
    p.add_argument("--scores", help="write our outputs here (npz)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="activation precision (float32 = the reference's exact semantics)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        convert_and_score(args.hf_dir, args.out, weights=args.weights, inputs=args.inputs, out=args.scores,
                          reference=args.reference, dtype=args.dtype, as_json=args.json)
    except (ConfigError, ConvertError, ScoreInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
