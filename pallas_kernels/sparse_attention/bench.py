"""sparse_attention on the device: the Mosaic kernel against the XLA reference at V4.1's geometry, one JSON
line per measurement (median of ``--iters`` runs; decode-sized calls by profiler device time).

``python -m pallas_kernels.sparse_attention.bench [--check] [--iters 20] [--only release|small|backward]``.
``--check`` first compares the kernel (with the XLA backward and with the Triton one) with the reference
(relative L2 per output row, forward and both gradients) and prints the worst row. TFLOP/s count the work
actually done: 4·N·H flops per visible key of each query (Q·K and P·V).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchutil, devtime, triton_atomics
from pallas_kernels.sparse_attention import api, layout, reference, triton_mqa
from pallas_kernels.sparse_attention import mosaic as mk

N, H, WINDOW, TOPK = 64, 512, 128, 512  # release geometry (spec attention §3)
TRITON_VARIANTS = ((32, 4), (64, 4), (32, 8), (64, 8))  # triton_mqa's (key rows a tile, warps); first: 16 x 256
PEAK_TFLOPS = 989.0  # H200 dense bf16


def inputs(b: int, s: int, t: int, *, n: int = N, h: int = H, window: int = WINDOW, topk: int = TOPK,
           ring: int = 0, seed: int = 0):
    """Random bf16 queries and keys, each query's top-k distinct entries of its causal prefix (−1 beyond), a
    window of ``window`` (and a ring prefix of ``ring`` slots for decode-shaped calls)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.bfloat16)
    wkv = jnp.asarray(rng.standard_normal((b, s, h)), jnp.bfloat16)
    ckv = jnp.asarray(rng.standard_normal((b, t, h)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    start = t * 4 - s if ring else 0  # decode: queries after the compressed prefix
    visible = np.clip((start + np.arange(s) + 1) // 4, 0, t)  # ratio-4 entries a query sees
    score = rng.random((b, s, t)) + (np.arange(t)[None, None] >= visible[None, :, None]) * -10
    top = np.argsort(-score, axis=-1, kind="stable")[..., :topk]
    top = np.where(np.take_along_axis(score, top, -1) >= 0, top, -1).astype(np.int32)
    kw = {}
    if ring:
        kw = dict(start=jnp.full((b,), start, jnp.int32),
                  prefix_kv=jnp.asarray(rng.standard_normal((b, ring, h)), jnp.bfloat16),
                  prefix_pos=jnp.broadcast_to(jnp.arange(start - ring, start, dtype=jnp.int32), (b, ring)))
    return (q, wkv, sink, window, ckv, jnp.asarray(top)), kw


def visible_keys(idx) -> int:
    return int((np.asarray(idx) >= 0).sum())


def rel_l2_rows(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm((got - want).reshape(-1, got.shape[-1]), axis=-1)
    ref = np.linalg.norm(want.reshape(-1, want.shape[-1]), axis=-1)
    return float((err / np.maximum(ref, 1e-30)).max())


def check(b, s, t, n, h, **kw) -> None:
    """Kernel (bf16) and the XLA path in bf16 against the XLA path in fp32 on the same inputs: the worst
    output row's relative L2 error of the forward, dq and dkv, and the log-sum-exp's and d sink's."""
    args, extra_kw = inputs(b, s, t, n=n, h=h, **kw)
    q, wkv, sink, window, ckv, top = args
    main, extra, idx = layout.key_rows(wkv, window, ckv, top, dtype=q.dtype, **extra_kw)
    scale = h ** -0.5
    g = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def grads(fn, *a):
        return jax.jit(jax.grad(lambda q, m, e, s_: (f32(fn(q, m, e, idx, s_)) * f32(g)).sum(), (0, 1, 2, 3)))(*a)

    ker = lambda *a: api.sparse_mqa(*a, scale)  # noqa: E731
    ref = lambda *a: reference.sparse_mqa(*a, scale)[0]  # noqa: E731
    with jax.default_matmul_precision("highest"):  # fp32 products on the GPU are TF32 by default
        want = jax.jit(ref)(f32(q), f32(main), f32(extra), idx, sink)
        dwant = grads(ref, f32(q), f32(main), f32(extra), sink)
        _, wlse = jax.jit(reference.sparse_mqa, static_argnums=5)(f32(q), f32(main), f32(extra), idx, sink, scale)
    for name, fn in (("kernel", ker), ("kernel+triton_bwd", ker), ("xla_bf16", ref)):
        api.TRITON_BACKWARD = name == "kernel+triton_bwd"  # read when the gradient is traced
        out = jax.jit(fn)(q, main, extra, idx, sink)
        d = grads(fn, q, main, extra, sink)
        api.TRITON_BACKWARD = False
        row = {"check": [b, s, t, n, h], **kw, "impl": name, "out": rel_l2_rows(out, want),
               "dq": rel_l2_rows(d[0], dwant[0]), "dmain": rel_l2_rows(d[1], dwant[1]),
               "dextra": rel_l2_rows(d[2], dwant[2]),
               "dsink": float(jnp.linalg.norm(d[3] - dwant[3]) / jnp.linalg.norm(dwant[3]))}
        if name == "kernel":
            row["lse_abs"] = float(jnp.abs(mk.sparse_mqa(q, main, extra, idx, sink, scale)[1] - wlse).max())
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def timed(fn, *args, iters: int, device: bool = False) -> float:
    if device:
        dt = devtime.device_time(fn, *args, calls=iters)
        if dt is not None:
            return dt["busy_us"]
    return benchutil.median_us(fn, *args, iters=iters)


def forward(b: int, s: int, t: int, iters: int, *, n: int = N, h: int = H, slots=(2,), **kw) -> None:
    args, extra = inputs(b, s, t, n=n, h=h, **kw)
    q, wkv, sink, window, ckv, top = args
    main, ext, idx = jax.jit(lambda *a: layout.key_rows(*a, dtype=q.dtype, **extra), static_argnums=1)(
        wkv, window, ckv, top)
    flops = 4 * n * h * visible_keys(idx)
    scale = h ** -0.5
    decode = s == 1
    rows = {
        f"kernel slots={k}": (jax.jit(lambda *a, k=k: mk.sparse_mqa(*a, scale, slots=k)[0]), (q, main, ext, idx, sink))
        for k in slots if mk.smem_bytes(h, idx.shape[-1], k) <= mk.SMEM_BYTES}
    for keys, warps in TRITON_VARIANTS if n < mk.HEADS else ():  # tile rows × warps; the first is the default
        if triton_mqa.applies(q, idx.shape[-1], keys):
            rows[f"triton {keys}x{warps}"] = (jax.jit(lambda *a, k=keys, w=warps: triton_mqa.sparse_mqa(
                *a, scale, keys=k, num_warps=w)[0]), (q, main, ext, idx, sink))
    rows |= {
        "kernel+layout": (jax.jit(lambda *a: api.sparse_attention(*a, backend="pallas", **extra),
                                  static_argnums=3), args),
        "xla": (jax.jit(lambda *a: api.sparse_attention(*a, backend="xla", **extra), static_argnums=3), args),
    }
    for name, (fn, a) in rows.items():
        try:
            us = timed(fn, *a, iters=iters, device=decode)
        except Exception as e:  # a variant that does not compile (registers, shared memory): say so, go on
            print(json.dumps({"op": "forward", "impl": name, "error": str(e).splitlines()[0][:200]}), flush=True)
            continue
        tf = flops / us / 1e6
        print(json.dumps({"op": "forward", "impl": name, "b": b, "s": s, "t": t, "n": n, "h": h, "us": round(us, 1),
                          "tflops": round(tf, 1), "peak_share": round(tf / PEAK_TFLOPS, 3),
                          "visible_keys_per_query": round(visible_keys(idx) / (b * s), 1),
                          "device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)


def backward(b: int, s: int, t: int, iters: int, *, n: int = N, h: int = H) -> None:
    """The backward alone (the Triton kernel in tile variants, and with Pallas's acquire-release atomic adds
    instead of ``triton_atomics``' relaxed ones, against XLA's gather + products + fp32 scatter, from the same
    log-sum-exp), then forward + backward through the model's call on each backend."""
    args, _ = inputs(b, s, t, n=n, h=h)
    q, wkv, sink, window, ckv, top = args
    g = jnp.ones(q.shape, q.dtype)
    main, extra, idx = layout.key_rows(wkv, window, ckv, top, dtype=q.dtype)
    flops = 2 * 4 * n * h * visible_keys(idx)  # dS·K, dS·Q, P·dO and dP = dO·K: twice the forward
    scale = h ** -0.5
    lse = jax.jit(lambda *a: reference.sparse_mqa(*a, scale)[1])(q, main, extra, idx, sink)
    alone = {f"triton_bwd {k}x{w}": jax.jit(lambda *a, k=k, w=w: triton_mqa.sparse_mqa_bwd(
        *a, scale, keys=k, num_warps=w)[:3]) for k, w in TRITON_VARIANTS}
    alone["triton_bwd acquire-release adds"] = jax.jit(lambda *a: triton_mqa.sparse_mqa_bwd(*a, scale)[:3])
    alone["xla"] = jax.jit(lambda q, m, e, i, lse_, g: api._bwd(scale, False, "cpu", (q, m, e, i, sink, lse_), g)[:3])
    for name, fn in alone.items():
        if "acquire-release" in name:  # Pallas's own adds: read when traced, so nothing cached may serve
            triton_atomics.USE_RELAXED = False
            jax.clear_caches()
        try:
            us = timed(fn, q, main, extra, idx, lse, g, iters=iters)
        except Exception as e:  # a variant that does not compile (registers, shared memory): say so, go on
            print(json.dumps({"op": "backward", "impl": name, "error": str(e).splitlines()[0][:200]}), flush=True)
            continue
        finally:
            triton_atomics.USE_RELAXED = triton_atomics.RELAXED
        tf = flops / us / 1e6
        print(json.dumps({"op": "backward", "impl": name, "b": b, "s": s, "t": t, "n": n, "h": h, "us": round(us, 1),
                          "tflops": round(tf, 1), "peak_share": round(tf / PEAK_TFLOPS, 3),
                          "device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    variants = [("pallas+triton_bwd", "pallas", False, True), ("pallas", "pallas", False, False),
                ("xla", "xla", False, False)]
    if n < mk.HEADS:
        variants.insert(0, ("triton fwd+bwd", "pallas", True, True))
    for name, backend, fwd, bwd in variants:
        def loss(q, wkv, ckv, sink, backend=backend):
            return (api.sparse_attention(q, wkv, sink, window, ckv, top, backend=backend) * g).sum()
        api.TRITON_FORWARD, api.TRITON_BACKWARD = fwd, bwd  # read when the call is traced (the first call)
        fn = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
        fn(q, wkv, ckv, sink)
        api.TRITON_FORWARD = api.TRITON_BACKWARD = False
        us = timed(fn, q, wkv, ckv, sink, iters=iters)
        tf = flops / us / 1e6  # the forward (recomputed or not) is inside the timed grad
        print(json.dumps({"op": "forward+backward", "impl": name, "b": b, "s": s, "t": t, "n": n, "h": h,
                          "us": round(us, 1),
                          "tflops_bwd_counted": round(tf, 1), "device": jax.devices()[0].device_kind}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true")
    p.add_argument("--long", action="store_true", help="also 64K queries")
    p.add_argument("--only", choices=["release", "small", "backward"], default=None,
                   help="release: 64 heads x 512; small: configs/small.yaml's 16 heads x 256 at 8K; backward: the "
                        "backward rows of both")
    args = p.parse_args()
    if args.only == "backward":
        backward(1, 8192, 2048, max(3, args.iters // 2), n=16, h=256)
        backward(1, 8192, 2048, max(3, args.iters // 2))
        return
    if args.only == "small":
        forward(1, 8192, 2048, args.iters, n=16, h=256, slots=(2, 3))
        backward(1, 8192, 2048, max(3, args.iters // 2), n=16, h=256)
        return
    if args.check:
        for case in [dict(b=2, s=130, t=40, n=64, h=512), dict(b=1, s=70, t=300, n=16, h=256),
                     dict(b=3, s=1, t=700, n=64, h=512, ring=128), dict(b=1, s=64, t=20, n=4, h=64, window=8,
                                                                       topk=16)]:
            check(**case)
    forward(1, 8192, 2048, args.iters)
    if args.long:
        forward(1, 65536, 16384, max(3, args.iters // 4))
    for b in (1, 32, 128):
        forward(b, 1, 32768, args.iters, ring=128)
    backward(1, 8192, 2048, max(3, args.iters // 2))


if __name__ == "__main__":
    main()
