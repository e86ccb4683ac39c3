"""The reference side of the CED server test: greedy tokens from the engine's ``Generator`` as ``dsv41 sample``
runs it (token-id prompts, and text prompts with ``--image``: ``encode_prompts`` and ``_image_prompts``), with
the server's compiled shapes (4 rows, its prefill chunk, 4-step decode blocks, 20 top logprobs) so that
every program is read back from the server's compilation cache ($DSV41_COMPILE_CACHE). Run as a child:
``python generator_child.py REQUEST.json``; one JSON line of generated ids."""

from __future__ import annotations

import json
import sys

from tokenizers import Tokenizer

from dsv41_jax import compile_cache
from dsv41_jax.checkpoint.load import load_model
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.sample import _image_prompts, encode_prompts


def main(request: dict) -> dict:
    compile_cache.enable()
    hf_dir = request["hf_dir"]
    loaded = load_model(hf_dir=hf_dir, dtype="float32")
    cfg = loaded.model.cfg
    sampling = SamplingConfig(temperature=0.0, stop_tokens=(cfg.eos_token_id,), max_new_tokens=request["max_new"],
                              prefill_chunk=request["prefill_chunk"], prefill_mode=request["prefill_mode"], block=4)
    gen = Generator(loaded.model, device_engram(loaded.hasher), 4, 256, sampling, top_logprobs=20)
    out = {"ids": gen.generate(request["ids"])}
    tok = Tokenizer.from_file(str(loaded.tokenizer))
    batch = encode_prompts(tok, cfg.bos_token_id, request["texts"], cfg.image_token_id)
    vision, batch = _image_prompts(batch, request["images"], cfg, ckpt=None, hf_dir=hf_dir, dtype="float32")
    out["images"] = gen.generate(batch, images=vision)
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(json.dumps(main(json.load(f))) + "\n")
