"""ViT + aligner throughput and the time to first token of an image prompt (spec model §7).

Prints one JSON line per measurement.
Usage: python benchmarks/vision_bench.py tower|ttft|all [--batches 1,8] [--reps 10] [--toy]

``tower``: images/s through the ViT and the aligner at the release's dimensions (spec model §7.1-7.2: 32 blocks,
width 1024, 16 heads of 64, MLP 2816, patch 14, the 3×3 aligner into the release width 5120; bf16, random
weights) for a 544² image (the processor's minimum: 39×39 patches, a 13×13 LLM grid, a 184-position span) and
for an image at the 1024-position span cap (a 4096² picture planned down to 93×93 patches, a 31×31 grid), with
``--batches`` images of one grid per call. Each call is one jitted program (ViT, then aligner); median of
``--reps`` after a warm-up.

``ttft``: an image prompt on ``engine_bench.py``'s model (the release's 40 layers and attention geometry, dim
2048, 16 experts; bf16, random weights) with a release-size tower whose aligner maps into 2048: the time from
the decoded picture and the prompt's ids to the first greedy token on the host (the processor's resize and
patches on the host, the tower, the span embeddings, the exact or CED prefill in one chunk), for the same two
image sizes with 64 text tokens around the image; after a warm-up run, median of ``--reps``, with the
median of each stage.

``--toy``: the tiny config's tower and backbone, 84² pictures and a span cap of 30 positions: a CPU smoke run
of the script (its numbers say nothing about the device).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import bench_config, draw  # noqa: E402

from dsv41_jax import config as Cfg  # noqa: E402
from dsv41_jax.vision.encoder import VisionEncoder, encode  # noqa: E402
from dsv41_jax.vision.processor import plan_image_grid  # noqa: E402

SIZES = {"544": (544, 544), "cap": (4096, 4096)}  # width, height of the picture handed to the processor
TOY_SIZES = {"544": (84, 84), "cap": (168, 168)}


def median_time(fn, reps: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn())  # warm-up: compiles
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def tower(vcfg: Cfg.VisionConfig, dim: int, dtype: str) -> VisionEncoder:
    """A vision tower with random weights (``engine_bench.draw``), its aligner into ``dim``."""
    abstract = nnx.eval_shape(lambda: VisionEncoder(vcfg, dim, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.merge(*draw(abstract))


def bench_tower(vcfg: Cfg.VisionConfig, dim: int, dtype: str, sizes: dict, batches: list[int], reps: int) -> None:
    graphdef, state = nnx.split(tower(vcfg, dim, dtype))
    rng = np.random.default_rng(0)
    for name, (w, h) in sizes.items():
        plan = plan_image_grid(w, h, vcfg)
        n_h, n_w = plan.vit_grid(vcfg.patch_size)
        run = jax.jit(lambda st, p, n_h=n_h, n_w=n_w: encode(nnx.merge(graphdef, st), p, n_h, n_w)[1])
        for b in batches:
            patches = jnp.asarray(rng.uniform(-1, 1, (b, n_h * n_w, 3, vcfg.patch_size, vcfg.patch_size)), dtype)
            sec, rows = median_time(lambda run=run, patches=patches: run(state, patches), reps)
            assert rows.shape == (b, plan.n_llm_h * plan.n_llm_w, dim)
            print(json.dumps({"bench": "vit_aligner", "image": name, "pixels": [plan.height, plan.width],
                              "patches": n_h * n_w, "llm_grid": [plan.n_llm_h, plan.n_llm_w],
                              "span": plan.span_len, "images_per_call": b, "ms": sec * 1e3,
                              "images_per_s": b / sec}), flush=True)


def bench_ttft(cfg: Cfg.ModelConfig, sizes: dict, modes: tuple[str, ...], reps: int, chunk: int,
               max_seq_len: int) -> None:
    from dsv41_jax.engine.sampling import Generator, SamplingConfig
    from dsv41_jax.engram_device import device_engram
    from dsv41_jax.engram_hash import EngramHasher
    from dsv41_jax.model.transformer import abstract_model
    from dsv41_jax.vision.processor import process_image
    from dsv41_jax.vision.prompt import ImageEncoder

    model = nnx.merge(*draw(abstract_model(cfg)))
    encoder = ImageEncoder(tower(cfg.vision, cfg.dim, cfg.dtype))
    tables = device_engram(EngramHasher(cfg.engram, np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size))
    rng = np.random.default_rng(0)
    text = rng.integers(4, min(cfg.vocab_size, 1000), 64).tolist()
    prompt = [cfg.bos_token_id, *text[:32], cfg.image_token_id, *text[32:]]
    for mode in modes:
        gen = Generator(model, tables, 1, max_seq_len, SamplingConfig(
            temperature=0, max_new_tokens=1, stop_tokens=(), block=1, prefill_chunk=chunk, prefill_mode=mode))
        for name, (w, h) in sizes.items():
            rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            stages: dict[str, list[float]] = {"processor": [], "tower": [], "prefill": []}

            def first_token(rgb=rgb, stages=stages, gen=gen) -> int:
                t0 = time.perf_counter()
                image = process_image(rgb, cfg.vision)
                t1 = time.perf_counter()
                inputs = encoder.prompt_inputs([prompt], [image], cfg.image_token_id)
                jax.block_until_ready(inputs.embeds)
                t2 = time.perf_counter()
                state = gen.prefill([inputs.ids[0, : inputs.lengths[0]].tolist()], inputs)
                token = int(np.asarray(state.logits[0]).argmax())
                for key, dt in zip(stages, (t1 - t0, t2 - t1, time.perf_counter() - t2), strict=True):
                    stages[key].append(dt)
                return token

            first_token()  # warm-up: compiles the tower for this grid and the prefill chunk
            for v in stages.values():
                v.clear()
            sec, _ = median_time(first_token, reps)
            print(json.dumps({"bench": "image_ttft", "mode": mode, "image": name, "prompt_tokens": len(prompt) - 1 +
                              plan_image_grid(w, h, cfg.vision).span_len, "chunk": chunk, "ttft_ms": sec * 1e3,
                              **{f"{k}_ms": float(np.median(v)) * 1e3 for k, v in stages.items()}}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("tower", "ttft", "all"))
    p.add_argument("--batches", default="1,8", help="images per tower call")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--modes", default="exact,ced", help="prefill modes of the ttft runs")
    p.add_argument("--toy", action="store_true", help="tiny config and pictures: a CPU smoke run")
    args = p.parse_args(argv)
    if args.toy:
        cfg = Cfg.tiny().replace(dtype="float32", param_dtype="float32")
        cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, min_pixels=84 * 84, max_n_token=30))
        release, sizes, chunk, max_seq_len = cfg, TOY_SIZES, 64, 128
    else:
        release, cfg, sizes, chunk, max_seq_len = Cfg.v41_flash(), bench_config(), SIZES, 2048, 2048
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "toy": args.toy,
                      "vision": dataclasses.asdict(release.vision)}), flush=True)
    if args.what in ("tower", "all"):
        bench_tower(release.vision, release.dim, "float32" if args.toy else "bfloat16", sizes,
                    [int(b) for b in args.batches.split(",")], args.reps)
    if args.what in ("ttft", "all"):
        bench_ttft(cfg, sizes, tuple(args.modes.split(",")), args.reps, chunk, max_seq_len)


if __name__ == "__main__":
    main()
