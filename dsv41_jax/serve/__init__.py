"""``dsv41 serve``: an OpenAI-compatible HTTP server over the engine, with continuous batching and a tiered
prefix cache (optional extra ``serve``: FastAPI, uvicorn, prometheus-client, Jinja2).

:func:`build` loads the model and compiles every shape before the port opens; :func:`serve` then runs uvicorn.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeOptions:
    max_batch: int = 8
    max_seq_len: int = 4096
    max_queue: int = 256
    prefill_mode: str = "ced"
    prefill_chunk: int = 512
    block: int = 8  # decode steps per compiled block: requests join and leave between blocks
    dtype: str = "bfloat16"
    mesh: str | None = None
    name: str | None = None
    prefix_cache_dir: str | None = None
    host_cache_gb: float = 8.0
    disk_cache_gb: float = 256.0
    swa_pool_gb: float = 2.0
    swa_ttl: float = 300.0
    allowed_local_media_path: str | None = None  # image parts may name local files under this directory


def build(opts: ServeOptions, *, run: str | os.PathLike | None = None, ckpt: str | os.PathLike | None = None,
          hf_dir: str | os.PathLike | None = None, log: Callable[[str], None] = print):
    """The FastAPI app and its scheduler (already compiled and running)."""
    import jax
    from tokenizers import Tokenizer

    from dsv41_jax.config import ConfigError
    from dsv41_jax.engine.mesh import load_for_serving
    from dsv41_jax.engine.sampling import Generator, SamplingConfig
    from dsv41_jax.engram_device import device_engram
    from dsv41_jax.serve.api import Served, create_app
    from dsv41_jax.serve.metrics import Metrics
    from dsv41_jax.serve.prefix_cache import PrefixCache
    from dsv41_jax.serve.scheduler import Scheduler
    from dsv41_jax.serve.text import ChatTemplate

    loaded, mesh = load_for_serving(opts.mesh, run=run, ckpt=ckpt, hf_dir=hf_dir, dtype=opts.dtype, log=log)
    cfg = loaded.model.cfg
    tok = Tokenizer.from_file(str(loaded.tokenizer))
    sampling = SamplingConfig(temperature=0.0, stop_tokens=(cfg.eos_token_id,), prefill_chunk=opts.prefill_chunk,
                              prefill_mode=opts.prefill_mode, block=opts.block)
    try:  # before anything compiles: settings the engine refuses are the user's one-line error
        gen = Generator(loaded.model, device_engram(loaded.hasher), opts.max_batch, opts.max_seq_len, sampling,
                        mesh=mesh, top_logprobs=20)
        jax.eval_shape(gen.empty)
    except ValueError as err:
        raise ConfigError(f"dsv41 serve: {err}") from None
    gb = 1 << 30
    cache = PrefixCache(host_bytes=int(opts.host_cache_gb * gb), disk_dir=opts.prefix_cache_dir,
                        disk_bytes=int(opts.disk_cache_gb * gb), swa_bytes=int(opts.swa_pool_gb * gb),
                        swa_ttl=opts.swa_ttl)
    if cache.disk:
        log(f"prefix cache: {len(cache.disk)} conversations on disk in {opts.prefix_cache_dir}")
    metrics = Metrics()
    metrics.batch_rows.set(opts.max_batch)
    scheduler = Scheduler(gen, tok, metrics, eos=cfg.eos_token_id, max_queue=opts.max_queue, prefix_cache=cache,
                          log=log)
    scheduler.warm_up()
    scheduler.start()
    source = Path(run or ckpt or hf_dir)
    served = Served(scheduler, tok, ChatTemplate.from_tokenizer_dir(loaded.tokenizer.parent, tok, cfg.bos_token_id,
                                                                    cfg.eos_token_id),
                    metrics, opts.name or source.resolve().name, opts.max_seq_len, cfg.vocab_size, cfg.bos_token_id,
                    _image_inputs(loaded.model, opts, run=run, ckpt=ckpt, hf_dir=hf_dir, log=log),
                    tok.id_to_token(cfg.image_token_id) or "")
    return create_app(served), scheduler


def _image_inputs(model, opts: ServeOptions, *, run, ckpt, hf_dir, log: Callable[[str], None]):
    """The vision path of image parts (the checkpoint's tower, or the run's own), or None without a tower."""
    from dsv41_jax.checkpoint.load import vision_encoder
    from dsv41_jax.serve.images import ImageInputs
    from dsv41_jax.vision.prompt import ImageEncoder

    if run is not None:
        tower = model if hasattr(model, "vision") else None
    else:
        try:
            tower = vision_encoder(ckpt=ckpt, hf_dir=hf_dir, dtype=opts.dtype)
        except ValueError:  # a text-only checkpoint
            tower = None
    if tower is None:
        log("images: off (the checkpoint has no vision tower)")
        return None
    cfg = model.cfg
    return ImageInputs(ImageEncoder(tower), cfg.vision, cfg.image_token_id, cfg.pad_token_id,
                       opts.allowed_local_media_path)


def serve(opts: ServeOptions, *, host: str = "127.0.0.1", port: int = 8000, log: Callable[[str], None] = print,
          **source) -> None:
    import uvicorn

    app, scheduler = build(opts, log=log, **source)
    log(f"serving on http://{host}:{port}/v1 (max batch {opts.max_batch}, max_seq_len {opts.max_seq_len})")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        scheduler.stop()
