"""Decode and prefill timings of the inference engine on a config with the release's layer structure.

Prints one JSON line per measurement; a decode step also prints the bytes it needs (:func:`decode_floor`,
computed, not XLA's count), that floor's time at 4.3 TB/s and the measured step's share of it.
Usage: python benchmarks/engine_bench.py decode|prefill|decode+prefill|parts|cost ...
[--mesh=DxFxExT] (decode: weights placed by the sharding table, sequences over data×expert, MoE expert-parallel)
[--moe=auto|gather|grouped] (the routed experts' path, model.moe.routed_path)
[--weights=float|native] (native: the release's FP8 linears and MXFP4 experts with E8M0 scales, random codes)
[--kernels=xla|pallas|xla,pallas] (attention.kernel_backend: pallas_kernels' kernels where they apply; a list
measures each backend on the same weights)
[--decode-kernels=0|1] (with --kernels=pallas, the Triton decode kernels both off or both on:
index_scan.api.GPU_KERNEL, on by default, and sparse_attention.api.PACKED_DECODE, off by default)
[--radix-topk=N] (decode: the KV sources' top-k by the radix select from N entries, attention.RADIX_TOPK_MIN_ENTRIES)
[--loop=N] (decode: N steps in one compiled loop with the cache donated, as the generator runs them, per step)
[--profile=DIR] (decode: a trace of 3 steps of each case and its HLO, for ``profile_split.py DIR/bB_cC --steps 3``).
``moe BATCHES [PATHS]``: one MoE layer at the release's dimensions with MXFP4 experts, each routed path.
Sizes: the release's attention and indexer geometry (64 heads × 512, index 32 × 128, top-k 512, window 128,
2048 candidate blocks of 8) and all 40 layers with their roles; a narrower residual (dim 2048) and fewer,
smaller experts so that it fits one H200 in bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import cache as C
from dsv41_jax import config as Cfg
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_hash import engram_primes
from pallas_kernels.benchutil import median_us_carry


def bench_config() -> Cfg.ModelConfig:
    base = Cfg.v41_flash()
    e = dataclasses.replace(base.engram, vocab_size=4000)
    e = dataclasses.replace(e, num_embeddings=tuple(int(x) for x in engram_primes(e).sum(axis=(1, 2))))
    return base.replace(dim=2048, dtype="bfloat16", param_dtype="bfloat16", engram=e,
                        moe=dataclasses.replace(base.moe, n_routed_experts=16, moe_inter_dim=1024))


# ----------------------------------------------------------------------------------------------------
# the bytes a decode step needs

COPY_TB_PER_S = 4.3  # the H200's copy rate from a good kernel (notes/PLATFORM.md; XLA's own copy: 2.8)


def expected_experts(n: int, k: int, batch: int) -> float:
    """Distinct experts that ``batch`` tokens pick, each ``k`` distinct of ``n``, in expectation under balanced,
    independent routing (what the aux-loss-free balance aims at): ``n · (1 − (1 − k/n)^batch)``; k at batch 1."""
    return n * (1.0 - (1.0 - k / n) ** batch)


def weight_reads(cfg: Cfg.ModelConfig, batch: int) -> dict[str, float]:
    """Bytes of the parameters one decode step of ``batch`` sequences reads, at their stored dtypes (the
    abstract parameter tree, so ``weight_format: native`` counts FP8 / MXFP4 codes and E8M0 scales): every
    parameter once, except the routed experts (:func:`expected_experts` of each layer's E), the token
    embedding (one row per sequence), the Engram tables (``n_columns`` rows per sequence and layer) and the
    image-token router bias (unused by text)."""
    return _reads(_parameter_bytes(cfg), cfg, batch)


def _reads(params, cfg: Cfg.ModelConfig, batch: int) -> dict[str, float]:
    """:func:`weight_reads` of ``params``, (checkpoint name, bytes, leading dimension) triples."""
    m = cfg.moe
    picked = expected_experts(m.n_routed_experts, m.n_activated_experts, batch) / m.n_routed_experts
    out = {"routed_experts": 0.0, "embedding_rows": 0.0, "engram_rows": 0.0, "other_weights": 0.0}
    for name, nbytes, rows in params:
        if ".ffn.experts." in name:
            out["routed_experts"] += nbytes * picked
        elif name == "embed.weight":
            out["embedding_rows"] += nbytes * min(batch / rows, 1.0)
        elif ".engram.embed." in name:
            out["engram_rows"] += nbytes * min(batch * cfg.engram.n_columns / rows, 1.0)
        elif not name.endswith(".ffn.gate.bias_vl"):
            out["other_weights"] += nbytes
    return out


@functools.cache
def _parameter_bytes(cfg: Cfg.ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """(name, bytes, leading dimension) of each backbone parameter, from the abstract tree (no memory)."""
    from dsv41_jax.checkpoint.tree import NON_BACKBONE_PREFIXES
    from dsv41_jax.model.transformer import abstract_model

    return tuple(t for t in _leaf_bytes(abstract_model(cfg)) if not t[0].startswith(NON_BACKBONE_PREFIXES))


def _leaf_bytes(module: nnx.Module, prefix: str = "") -> tuple[tuple[str, int, int], ...]:
    from dsv41_jax.checkpoint.tree import flat_variables

    return tuple((prefix + name, math.prod(v.shape) * jnp.dtype(v.dtype).itemsize, v.shape[0] if v.shape else 1)
                 for name, v in flat_variables(module).items())


def cache_reads(cfg: Cfg.ModelConfig, batch: int, context: int) -> dict[str, float]:
    """Bytes of the packed caches one decode step reads at ``context`` tokens, each byte once: every layer's
    SWA ring (``window`` entries, FP8 + E8M0 per 32), each KV source's index keys in full (MXFP4: the Full
    layer's scan; a Reindex layer scores a subset of the same keys) and compressor carry (ratio 2), and the
    ``index_topk`` main-KV entries (NVFP4) of each distinct (KV source, top-k source) pair (Reuse layers
    attend to their source's picks). Writes (one ring slot, at most one entry per source) are left out."""
    from dsv41_jax.topology import topology

    a = cfg.attention
    h, i = a.head_dim, a.index_head_dim
    ring, main_entry, index_entry = h + h // 32, h // 2 + h // 16, i // 2 + i // 32
    specs = topology(cfg)
    pairs = {(s.kv_source, s.topk_source) for s in specs if s.compressed}
    out = {"swa_rings": cfg.n_layers * a.window_size * ring,
           "index_keys": sum(context // a.compress_ratios[s] * index_entry for s in a.kv_source_layers),
           "compressor_carry": sum(2 * h * 4 for s in a.kv_source_layers if a.compress_ratios[s] == 2),
           "attended_entries": sum(min(a.index_topk, context // a.compress_ratios[kv]) * main_entry
                                   for kv, _ in pairs)}
    return {k: v * batch for k, v in out.items()}


def decode_floor(cfg: Cfg.ModelConfig, batch: int, context: int) -> dict[str, float]:
    """The bytes a decode step needs (:func:`weight_reads` + :func:`cache_reads`) by part, their ``total`` and
    ``floor_ms``, the time to read them once at :data:`COPY_TB_PER_S`."""
    parts = {**weight_reads(cfg, batch), **cache_reads(cfg, batch, context)}
    total = sum(parts.values())
    return {**parts, "total": total, "floor_ms": total / (COPY_TB_PER_S * 1e12) * 1e3}


# ----------------------------------------------------------------------------------------------------


def timeit(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def build(cfg, mesh=None):
    """The model of ``cfg`` with random weights (:func:`draw`)."""
    from dsv41_jax.model.transformer import abstract_model

    return draw(abstract_model(cfg), mesh)


def with_config(cfg):
    """The graph definition of ``cfg``'s model: the same parameter tree under another runtime choice (the
    kernel backend), so that one set of drawn weights serves both programs."""
    from dsv41_jax.model.transformer import abstract_model

    return nnx.graphdef(abstract_model(cfg))


def draw(module: nnx.Module, mesh=None):
    """``nnx.split`` of the abstract ``module`` with random weights drawn leaf by leaf on the device (one small
    program per distinct shape and sharding; a single jitted construction compiles one threefry per parameter
    and takes minutes at 40 layers). Native storage gets random E2M1 / FP8 codes and E8M0 scales of 1. With a
    ``mesh`` each leaf is drawn already sharded by the sharding table (``dsv41_jax.sharding``)."""
    from jax.sharding import NamedSharding

    from dsv41_jax.checkpoint.tree import flat_variables
    from dsv41_jax.sharding import logical_to_mesh

    key = jax.random.key(0)
    fns = {}
    for i, (name, var) in enumerate(sorted(flat_variables(module).items())):
        shape, dtype = tuple(var.shape), var.dtype
        if dtype == jnp.uint8:
            kind = "e8m0" if name.endswith("scale") else "codes"
        else:
            kind = "normal" if len(shape) >= 2 else "zeros" if any(t in name for t in ("bias", "sink", "base")) \
                else "ones"
        axes = var.get_metadata().get("out_sharding")
        sharding = None
        if mesh is not None:
            spec = logical_to_mesh(tuple(axes), shape=shape, mesh=mesh) if axes else jax.sharding.PartitionSpec()
            sharding = NamedSharding(mesh, spec)
        sig = (kind, shape, str(dtype), sharding)
        if sig not in fns:
            def leaf(k, kind=kind, shape=shape, dtype=dtype):
                if kind == "normal":
                    return (jax.random.normal(k, shape, jnp.float32) * shape[-1] ** -0.5).astype(dtype)
                if kind == "codes":
                    return jax.random.randint(k, shape, 0, 256, jnp.int32).astype(dtype)
                if kind == "e8m0":
                    return jnp.full(shape, 127, dtype)
                return (jnp.zeros if kind == "zeros" else jnp.ones)(shape, dtype)
            fns[sig] = jax.jit(leaf, out_shardings=sharding)
        var.set_value(fns[sig](jax.random.fold_in(key, i)))
    return nnx.split(module)


def moe_layer(cfg: Cfg.ModelConfig, batches, paths=("gather", "grouped"), reps=10):
    """One MoE layer of ``cfg`` (the release: dim 5120, 384 experts of 2304, k 6) with its experts in MXFP4, one
    token per sequence, bf16: the step's time on each routed path against the bytes it needs (the experts the
    batch picks, router and shared expert)."""
    from dsv41_jax.model.moe import MoE

    m = cfg.moe

    def layer(path):
        return nnx.eval_shape(lambda: MoE(dataclasses.replace(m, routed_path=path), cfg.dim, m.n_routed_experts,
                                          m.n_activated_experts, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                          rngs=nnx.Rngs(0), native=True))

    _, state = draw(layer("auto"))
    params = _leaf_bytes(layer("auto"), "layers.0.ffn.")
    for b in batches:
        x = jax.random.normal(jax.random.key(b), (b, 1, cfg.dim), jnp.bfloat16)
        needed = sum(_reads(params, cfg, b).values())
        for path in paths:
            graphdef = nnx.graphdef(layer(path))
            sec, _ = timeit(jax.jit(lambda st, x, g=graphdef: nnx.merge(g, st)(x)[0]), state, x, reps=reps)
            print(json.dumps({"bench": "moe_layer", "experts": m.n_routed_experts, "k": m.n_activated_experts,
                              "dim": cfg.dim, "inter": m.moe_inter_dim, "batch": b, "path": path, "ms": sec * 1e3,
                              "bytes_needed_GB": needed / 1e9,
                              "floor_ms": needed / (COPY_TB_PER_S * 1e12) * 1e3,
                              "share_of_4.3TBps": needed / (COPY_TB_PER_S * 1e12) / sec}), flush=True)


def decode_kernels() -> dict:
    from pallas_kernels.index_scan import api as scan_api
    from pallas_kernels.sparse_attention import api as sparse_api

    return {"index_scan": scan_api.GPU_KERNEL, "packed_decode": sparse_api.PACKED_DECODE}


def radix_topk():
    from dsv41_jax.model import attention

    return attention.RADIX_TOPK_MIN_ENTRIES


def decode(graphdef, state, cfg, contexts, batches, mesh=None, profile=None, loop=0):
    """One decode step per (batch, context); with ``profile`` (a directory), a trace of the last one's steps and
    its HLO under ``profile/b{batch}_c{context}`` for ``profile_split.py``.

    ``loop`` > 0 times what the engine's generator runs instead (``Generator.decode_block``): ``loop`` steps in
    one compiled ``fori_loop`` with the cache donated, each step feeding its greedy token back (the Engram rows
    stay fixed), reported per step: the median of 5 calls after a warm-up (``benchutil.median_us_carry``; a
    trace: 3 more calls on a fresh cache, so ``profile_split.py --steps 3·loop``)."""
    from dsv41_jax.engine.sampling import SERVE_BATCH
    from dsv41_jax.model.moe import expert_parallel
    from dsv41_jax.sharding import named_shardings

    rows_per = [n for n in cfg.engram.num_embeddings]

    def one_step(st, c, t, r):
        with expert_parallel(mesh):
            return forward_chunk(nnx.merge(graphdef, st), c, t, r, jnp.ones((t.shape[0],), jnp.int32))

    def loop_steps(st, c, t, r):
        model = nnx.merge(graphdef, st)

        def body(_, carry):
            c, t = carry
            with expert_parallel(mesh):
                logits, c = forward_chunk(model, c, t, r, jnp.ones((t.shape[0],), jnp.int32))
            return c, jnp.argmax(logits, -1).astype(jnp.int32)[:, None]

        return jax.lax.fori_loop(0, loop, body, (c, t))

    def fresh_cache(b, ctx):
        cache = C.init_cache(cfg, b, ctx + max(128, 6 * loop))  # 6 calls of `loop` steps past the context
        cache = cache._replace(lengths=jnp.full((b,), ctx, jnp.int32))  # cost depends on shapes, not values
        if mesh is not None:
            cache = jax.device_put(cache, named_shardings(mesh, C.cache_partition_specs(cache, mesh,
                                                                               batch_axis=SERVE_BATCH)))
        return cache

    for b in batches:
        for ctx in contexts:
            cache = fresh_cache(b, ctx)
            tokens = (jnp.arange(b, dtype=jnp.int32)[:, None] * 7919 + 1) % cfg.vocab_size  # rows route apart
            rows = jnp.stack([jnp.full((b, 1, cfg.engram.n_columns), r // 2, jnp.int32) for r in rows_per], 2)
            cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
            t0 = time.perf_counter()
            if loop:
                step = jax.jit(loop_steps, donate_argnums=1).lower(state, cache, tokens, rows).compile()
            else:
                step = jax.jit(one_step).lower(state, cache, tokens, rows).compile()
            compile_s = time.perf_counter() - t0
            analysis = step.cost_analysis()
            analysis = analysis if isinstance(analysis, dict) else analysis[0]
            if loop:  # each call consumes the last one's cache
                def blocks(carry, step=step, rows=rows):
                    return step(state, *carry, rows)

                sec = median_us_carry(blocks, (cache, tokens), iters=5, warmup=1) / 1e6 / loop
                del cache
            else:
                sec, _ = timeit(step, state, cache, tokens, rows)
            if profile is not None:
                from profile_split import record

                if loop:  # on a fresh cache: the timed calls consumed theirs
                    held = [(fresh_cache(b, ctx), tokens)]

                    def again(held=held, blocks=blocks):
                        held[0] = blocks(held[0])
                        return held[0]
                else:
                    again = functools.partial(step, state, cache, tokens, rows)
                record(f"{profile}/b{b}_c{ctx}", step, again, steps=3)
            weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
            # XLA's count of bytes the step's kernels read and write (weights, caches, intermediates)
            accessed = analysis.get("bytes accessed", float("nan")) / max(loop, 1)
            floor = decode_floor(cfg, b, ctx)
            print(json.dumps({"bench": "decode_step", "mesh": None if mesh is None else dict(mesh.shape),
                              "kernels": cfg.attention.kernel_backend, "radix_topk": radix_topk(),
                              "decode_kernels": decode_kernels(),
                              "moe": cfg.moe.routed_path, "loop": loop, "batch": b, "context": ctx, "ms": sec * 1e3,
                              "tokens_per_s": b / sec, "compile_s": compile_s, "cache_GB": cache_bytes / 1e9,
                              "weights_GB": weight_bytes / 1e9, "bytes_accessed_GB": accessed / 1e9,
                              "achieved_GB_per_s": accessed / sec / 1e9,
                              "bytes_needed_GB": floor["total"] / 1e9, "floor_ms": floor["floor_ms"],
                              "share_of_4.3TBps": floor["floor_ms"] / (sec * 1e3),
                              "needed_GB": {k: v / 1e9 for k, v in floor.items() if k not in ("total", "floor_ms")}}),
                  flush=True)
            if not loop:
                del cache


def prefill(graphdef, state, cfg, lengths, chunk=2048, reps=3, modes=("exact", "ced")):
    cut = cfg.attention.candidate_source_layer + 1
    for n in lengths:
        for mode in modes:
            def run(mode=mode, n=n, fns={}):  # noqa: B006 -- one compiled function per chunk kind
                cache = C.init_cache(cfg, 1, n)
                logits = None
                for lo in range(0, n, chunk):
                    last = lo + chunk >= n
                    opts = ChunkOptions() if mode == "exact" else (
                        ChunkOptions(ced_cut=cut) if last else ChunkOptions(skip_from=cut))
                    if opts not in fns:
                        fns[opts] = jax.jit(lambda st, c, t, r, nn, o=opts: forward_chunk(
                            nnx.merge(graphdef, st), c, t, r, nn, options=o))
                    t = jnp.ones((1, chunk), jnp.int32)
                    r = jnp.zeros((1, chunk, len(cfg.engram.layer_ids), cfg.engram.n_columns), jnp.int32)
                    logits, cache = fns[opts](state, cache, t, r, jnp.array([chunk], jnp.int32))
                return logits
            sec, _ = timeit(run, reps=reps)
            print(json.dumps({"bench": "prefill", "mode": mode, "tokens": n, "s": sec, "chunk": chunk}), flush=True)


def parts(cfg, contexts, batches):
    """Per-layer pieces of a decode step: the candidate source's full indexer scan, a Reindex layer's
    candidate-restricted scoring, and the sparse attention over window + 512 picks."""
    from dsv41_jax.model.indexer import candidate_block_ids, gathered_index_scores, index_scores, select_topk
    from dsv41_jax.model.sparse import sparse_attention
    a = cfg.attention
    key = jax.random.key(0)
    for b in batches:
        for ctx in contexts:
            iq = jax.random.normal(key, (b, 1, a.index_n_heads, a.index_head_dim), jnp.bfloat16)
            w = jax.random.normal(key, (b, 1, a.index_n_heads), jnp.float32)
            keys = jax.random.normal(key, (b, ctx, a.index_head_dim), jnp.bfloat16)
            nv = jnp.full((b, 1), ctx, jnp.int32)

            def full_scan(iq, w, keys, nv):
                s = index_scores(iq, w, keys)
                return candidate_block_ids(s, nv, a.candidate_block_size, a.candidate_topk_blocks), \
                    select_topk(s, a.index_topk, nv)
            t_full, _ = timeit(jax.jit(full_scan), iq, w, keys, nv)
            pool = a.candidate_topk_blocks * a.candidate_block_size
            ck = jax.random.normal(key, (b, 1, min(pool, ctx), a.index_head_dim), jnp.bfloat16)
            t_re, _ = timeit(jax.jit(lambda iq, w, k: jax.lax.top_k(gathered_index_scores(iq, w, k), a.index_topk)),
                             iq, w, ck)
            q = jax.random.normal(key, (b, 1, a.n_heads, a.head_dim), jnp.bfloat16)
            kvw = jax.random.normal(key, (b, 1, a.head_dim), jnp.bfloat16)
            ring = jax.random.normal(key, (b, a.window_size, a.head_dim), jnp.bfloat16)
            picked = jax.random.normal(key, (b, 1, a.index_topk, a.head_dim), jnp.bfloat16)
            topk = jnp.broadcast_to(jnp.arange(a.index_topk, dtype=jnp.int32), (b, 1, a.index_topk))
            start = jnp.full((b,), ctx)
            ring_pos = jnp.broadcast_to(ctx - a.window_size + jnp.arange(a.window_size), (b, a.window_size))
            t_att, _ = timeit(jax.jit(lambda q, kvw, ring, picked, topk, start, ring_pos: sparse_attention(
                q, kvw, jnp.zeros((a.n_heads,)), a.window_size, topk=topk, picked=picked, start=start,
                prefix_kv=ring, prefix_pos=ring_pos)), q, kvw, ring, picked, topk, start, ring_pos)
            print(json.dumps({"bench": "decode_parts", "batch": b, "context": ctx, "full_scan_ms": t_full * 1e3,
                              "reindex_ms": t_re * 1e3, "attention_ms": t_att * 1e3}), flush=True)


def cost(cfg, lengths):
    """XLA's cost analysis of the lowered prefill programs (no device needed): CED over exact flops vs the
    prediction (E·N + D·W) / (L·N), E = layers through the candidate source, D = the rest."""
    from dsv41_jax.model.transformer import abstract_model

    graphdef, state = nnx.split(abstract_model(cfg))
    a = cfg.attention
    cut = a.candidate_source_layer + 1
    n_layers, w = cfg.n_layers, a.window_size
    for n in lengths:
        flops = {}
        for mode, opts in (("exact", ChunkOptions()), ("ced", ChunkOptions(ced_cut=cut))):
            fn = jax.jit(lambda st, c, t, r, nn, o=opts: forward_chunk(nnx.merge(graphdef, st), c, t, r, nn,
                                                                       options=o))
            cache = jax.eval_shape(lambda n=n: C.init_cache(cfg, 1, n))
            tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
            rows = jax.ShapeDtypeStruct((1, n, len(cfg.engram.layer_ids), cfg.engram.n_columns), jnp.int32)
            analysis = fn.lower(state, cache, tokens, rows, jax.ShapeDtypeStruct((1,), jnp.int32)).cost_analysis()
            flops[mode] = (analysis if isinstance(analysis, dict) else analysis[0])["flops"]
        print(json.dumps({"bench": "prefill_cost", "tokens": n, "exact_flops": flops["exact"],
                          "ced_flops": flops["ced"], "measured_ratio": flops["ced"] / flops["exact"],
                          "predicted_ratio": (cut * n + (n_layers - cut) * w) / (n_layers * n)}), flush=True)


if __name__ == "__main__":
    mesh = None
    for arg in [a for a in sys.argv if a.startswith("--mesh=")]:
        from dsv41_jax.train.step import build_mesh

        sys.argv.remove(arg)
        shape = tuple(int(x) for x in arg.split("=")[1].split("x"))
        mesh = build_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])
    flags = {"--moe": "auto", "--weights": "float", "--profile": None, "--loop": "0", "--kernels": "xla",
             "--radix-topk": None, "--decode-kernels": None}
    for arg in [a for a in sys.argv if a.split("=")[0] in flags]:
        sys.argv.remove(arg)
        flags[arg.split("=")[0]] = arg.split("=")[1]
    what = sys.argv[1] if len(sys.argv) > 1 else "decode"
    if flags["--decode-kernels"] is not None:  # the Triton decode kernels under kernel_backend pallas
        from pallas_kernels.index_scan import api as scan_api
        from pallas_kernels.sparse_attention import api as sparse_api

        scan_api.GPU_KERNEL = sparse_api.PACKED_DECODE = flags["--decode-kernels"] == "1"
    if flags["--radix-topk"] is not None:
        from dsv41_jax.model import attention

        attention.RADIX_TOPK_MIN_ENTRIES = int(flags["--radix-topk"])
    cfg = bench_config()
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, routed_path=flags["--moe"]), weight_format=flags["--weights"],
                      attention=dataclasses.replace(cfg.attention, kernel_backend=flags["--kernels"].split(",")[0]))
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "config": "release layers, dim 2048, "
                      "16 experts x 1024", "weights": cfg.weight_format}), flush=True)
    if what == "parts":
        parts(cfg, [4096, 16384, 65536, 131072], [1, 32])
        sys.exit()
    if what == "cost":
        cost(cfg, [int(x) for x in sys.argv[2].split(",")])
        sys.exit()
    if what == "moe":
        moe_layer(Cfg.v41_flash(), [int(x) for x in sys.argv[2].split(",")],
                  *([tuple(sys.argv[3].split(","))] if len(sys.argv) > 3 else []))
        sys.exit()
    graphdef, state = build(cfg, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(state))
    print(json.dumps({"params_B": n_params / 1e9}), flush=True)
    if what == "decode":
        for backend in flags["--kernels"].split(","):  # the same weights under each backend's program
            cfg_b = cfg.replace(attention=dataclasses.replace(cfg.attention, kernel_backend=backend))
            decode(with_config(cfg_b), state, cfg_b, [int(x) for x in sys.argv[2].split(",")],
                   [int(x) for x in sys.argv[3].split(",")], mesh, flags["--profile"], int(flags["--loop"]))
    elif what == "decode+prefill":  # one weight build for both (decode CONTEXTS BATCHES, prefill LENGTHS REPS)
        decode(graphdef, state, cfg, [int(x) for x in sys.argv[2].split(",")], [int(x) for x in sys.argv[3].split(",")],
               mesh)
        prefill(graphdef, state, cfg, [int(x) for x in sys.argv[4].split(",")], reps=int(sys.argv[5]),
                modes=tuple(sys.argv[6].split(",")) if len(sys.argv) > 6 else ("exact", "ced"))
    elif what == "prefill":
        prefill(graphdef, state, cfg, [int(x) for x in sys.argv[2].split(",")],
                reps=int(sys.argv[3]) if len(sys.argv) > 3 else 3)
