"""Sparse MQA forward on Hopper (Mosaic GPU): each query's 64 heads against its own list of key rows.

The shape no library kernel takes (``reference.sparse_mqa``): 64 query heads share one latent (K = V) of
H = 512 lanes, and every query has its own L key rows (512 selected compressed entries + its window), so
keys are gathered by row, not streamed as a contiguous band; cuDNN stops at head dim 256 and the Pallas /
tokamax flash kernels do not fit H = 512 in shared memory. Written by hand for that reason.

One CTA computes one query × one group of 64 heads with one warpgroup per ``HO`` = min(H, 256) output
lanes (two at H = 512), so each [64, HO] fp32 accumulator fits its warpgroup's registers (128 a thread). Both
warpgroups compute the full [64, 64] logits of a key tile (the Q·Kᵀ products are done twice; splitting the
contraction instead would need an exchange of partial logits through SMEM); they share Q and the key tiles in
SMEM. Per key tile of 64 rows:

* the rows are gathered from HBM with ``cp.async`` (16 bytes a thread and copy, a row's 64 chunks across
  64 consecutive threads, the warpgroups taking alternate rows), written straight into the 128-byte-swizzled
  tiles that ``wgmma`` reads, while the previous tile is computed (two SMEM slots; one CTA barrier a
  tile). Hopper's TMA has no row gather (``gather4`` is sm_100), and a TMA box cannot start inside an
  8-row tile, hence per-thread copies (inline PTX: Mosaic GPU's ``cp.async`` path has no gather);
* ``S = Q Kᵀ`` [64, 64] by ``wgmma`` (Q [64, H] in SMEM, loaded once by TMA), scaled, −∞ where the row
  list holds −1, online softmax in fp32 with the running max and denominator starting at the sink
  (``m = sink``, ``l = 1``: the sink joins the denominator only), P cast to the activation dtype;
* ``O += P · K[:, chunk]`` by ``wgmma``.

The output is divided by ``l`` and stored from registers; the log-sum-exp ``m + log l`` (for the backward
pass) by warpgroup 0. Interpreted (CPU), the same body runs with plain row copies instead of the ``cp.async``
gather and without register layouts (``mosaic_stream``'s convention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import mosaic_stream as ms

HEADS = 64  # wgmma's M: one CTA's query heads
KEYS = 64  # key rows a tile
MAX_CHUNK = 256  # output lanes a CTA: [64, 256] fp32 = 128 registers a thread
SWIZZLE = 128
TILE = (8, SWIZZLE // 2)  # 16-bit elements: 8 rows x 128 bytes, the unit of the 128-byte swizzle


def _smem_transforms(interpret: bool):
    return () if interpret else (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))


def _gather_ptx(row_bytes: int) -> str:
    """One 16-byte ``cp.async`` of a key row: $0 the row-list entry's SMEM address, $1 / $2 the thread's byte
    offset into a row plus the base of ``main`` / ``extra``, $3 the SMEM destination, $4 ``main``'s row
    count: entries from there on are rows of ``extra``. −1 entries read row 0 of ``main`` (their logits are
    masked), so no copy reads outside the arrays."""
    return "\n".join([
        "{", ".reg .s32 i;", ".reg .u64 g, base;", ".reg .pred x;",
        "ld.shared.s32 i, [$0];", "max.s32 i, i, 0;",
        "setp.ge.s32 x, i, $4;", "selp.u64 base, $2, $1, x;", "@x sub.s32 i, i, $4;",
        f"mul.wide.s32 g, i, {row_bytes};", "add.u64 g, g, base;",
        "cp.async.cg.shared.global [$3], [g], 16;", "}"])


def _issue_gather(h: int, n_wg: int, keys: int):
    """``issue(idx_ref, main_ref, extra_ref, dst_ref)``: this warpgroup's share of the ``keys`` rows (rows
    ``wg, wg + n_wg, ...`` in passes) of ``main`` / ``extra`` named by ``idx_ref`` into ``dst_ref`` [keys, H]
    (tiled (8, 64), 128-byte swizzle) with ``cp.async``, as one commit group."""
    chunks = h * 2 // 16  # 16-byte chunks a row
    rows_per_pass = 128 // chunks
    swizzled = plgpu.RefType(_smem_transforms(False))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), swizzled))
    def issue(ctx, idx_ref, main_ref, extra_ref, dst_ref):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, llvm, nvvm

        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c = lambda v, t=i32: mu.c(v, t)  # noqa: E731
        thread = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        wg, tid = arith.divui(thread, c(128)), arith.remui(thread, c(128))
        chunk, r0 = arith.remui(tid, c(chunks)), arith.divui(tid, c(chunks))
        r0 = arith.addi(arith.muli(r0, c(n_wg)), wg)  # warpgroups interleave their rows
        col_tile, in_tile = arith.divui(chunk, c(8)), arith.remui(chunk, c(8))
        idx_base = llvm.ptrtoint(i32, mu.memref_ptr(idx_ref))
        offset = arith.extui(i64, arith.muli(chunk, c(16)))
        src_main = arith.addi(llvm.ptrtoint(i64, mu.memref_ptr(main_ref)), offset)
        src_extra = arith.addi(llvm.ptrtoint(i64, mu.memref_ptr(extra_ref)), offset)
        n_main = c(ir.MemRefType(main_ref.type).shape[0])
        dst_base = llvm.ptrtoint(i32, mu.memref_ptr(dst_ref))
        for p in range(keys // (rows_per_pass * n_wg)):
            r = arith.addi(r0, c(p * rows_per_pass * n_wg))
            rlo = arith.remui(r, c(8))
            tile = arith.addi(arith.muli(arith.divui(r, c(8)), c(h // TILE[1])), col_tile)
            off = arith.addi(arith.muli(tile, c(1024)), arith.muli(rlo, c(128)))
            off = arith.addi(off, arith.muli(arith.xori(in_tile, rlo), c(16)))  # the 128-byte swizzle
            llvm.inline_asm(ir.Type.parse("!llvm.void"),
                            [arith.addi(idx_base, arith.muli(r, c(4))), src_main, src_extra,
                             arith.addi(dst_base, off), n_main],
                            _gather_ptx(h * 2), "r,l,l,r,r", has_side_effects=True)
        nvvm.cp_async_commit_group()

    return issue


def _land_but(pending: int):
    """``land()``: this thread's ``cp.async`` groups but the newest ``pending`` have landed and are visible to
    the async proxy (wgmma)."""
    @plgpu.inline_mgpu()
    def land(ctx):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir.dialects import nvvm

        nvvm.cp_async_wait_group(pending)
        mu.commit_shared()

    return land


_LAND = [_land_but(i) for i in range(2)]


@plgpu.inline_mgpu()
def _commit_empty(ctx):
    """An empty ``cp.async`` group: every step commits one, so ``wait_group(n)`` counts tiles."""
    del ctx
    from jaxlib.mlir.dialects import nvvm

    nvvm.cp_async_commit_group()


def _body(q_ref, main_ref, extra_ref, idx_ref, sink_ref, o_ref, lse_ref, q_smem, k_smem, idx_smem, sink_smem,
          bar, sync, *, scale: float, n_wg: int, chunk: int, slots: int, interpret: bool):
    qi, grp = lax.axis_index("q"), lax.axis_index("g")
    part = lax.axis_index("wg")  # this warpgroup's output lanes
    n_tiles, keys_a_tile = idx_smem.shape
    ahead = slots - 1  # tiles in flight while one is computed
    b, s = qi // q_ref.shape[1], qi % q_ref.shape[1]
    heads = pl.ds(grp * HEADS, HEADS)
    h = q_smem.shape[-1]

    @pl.when(part == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, s, heads], q_smem, bar)
        plgpu.copy_gmem_to_smem(idx_ref.at[b, s], idx_smem, bar)
        plgpu.copy_gmem_to_smem(sink_ref.at[heads], sink_smem, bar)
    plgpu.barrier_wait(bar)
    main, extra = main_ref.at[b], extra_ref.at[b]
    n_main = main_ref.shape[1]

    def cta_sync():  # every warpgroup's rows of the tile have landed; all are done with the previous tile
        plgpu.barrier_arrive(sync)
        plgpu.barrier_wait(sync)

    if interpret:
        def gather(t, slot):
            def row(j, carry):
                r = j * n_wg + part
                i = jnp.maximum(idx_smem[t, r], 0)
                src = jnp.where(i >= n_main, i - n_main, i)

                @pl.when(i < n_main)
                def _():
                    k_smem[slot, pl.ds(r, 1), :] = main[pl.ds(src, 1), :]

                @pl.when(i >= n_main)
                def _():
                    k_smem[slot, pl.ds(r, 1), :] = extra[pl.ds(src, 1), :]
                return carry
            lax.fori_loop(0, keys_a_tile // n_wg, row, 0)

        def land():
            pass

        def commit_empty():
            pass
        col_vec = lambda ref: ref[...]  # noqa: E731
        row_vec = col_vec
        as_acc = as_row = lambda x: x  # noqa: E731

        # the interpreter has no rule for run_state, nor for wgmma on a transposed ref: plain products
        def scores(queries, keys):
            return lax.dot_general(queries[...], keys[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        def accumulate(o, p, values):
            return o + jnp.dot(p, values[...], preferred_element_type=jnp.float32)
    else:
        issue = _issue_gather(h, n_wg, keys_a_tile)

        def gather(t, slot):
            issue(idx_smem.at[t], main, extra, k_smem.at[slot])

        land = _LAND[ahead - 1]
        commit_empty = _commit_empty
        col_vec = lambda ref: plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))  # noqa: E731
        row_vec = lambda ref: plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))  # noqa: E731
        as_acc = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
        as_row = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))  # noqa: E731

        def scores(queries, keys):
            def qk(acc):
                plgpu.wgmma(acc, queries, plgpu.transpose_ref(keys, (1, 0)))
                return acc[...]
            return pl.run_scoped(qk, plgpu.ACC((HEADS, keys_a_tile), jnp.float32))

        def accumulate(o, p, values):
            return pl.run_state(lambda acc: plgpu.wgmma(acc, p, values))(plgpu.ACC.init(o))

    for t in range(ahead):  # prologue: one commit group a tile, empty past the last
        @pl.when(t < n_tiles)
        def _(t=t):
            gather(t, t)

        @pl.when(t >= n_tiles)
        def _():
            commit_empty()
    m = row_vec(sink_smem).astype(jnp.float32)  # the sink starts the running max and denominator
    l_ = as_row(jnp.ones((HEADS,), jnp.float32))
    o = as_acc(jnp.zeros((HEADS, chunk), jnp.float32))

    def step(t, carry):
        o, m, l_ = carry
        slot = lax.rem(t, slots)
        land()  # tile t's group has landed (the ``ahead - 1`` newer ones may not have)
        cta_sync()

        @pl.when(t + ahead < n_tiles)
        def _():  # into the slot of tile t − 1, which every warpgroup is done with; overlaps these products
            gather(t + ahead, lax.rem(t + ahead, slots))

        @pl.when(t + ahead >= n_tiles)
        def _():
            commit_empty()

        keys = k_smem.at[slot]
        logits = scores(q_smem, keys) * scale
        ok = col_vec(idx_smem.at[t]) >= 0
        logits = jnp.where(lax.broadcast_in_dim(ok, logits.shape, [1]), logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
        l_ = l_ * alpha + p.sum(axis=1)
        o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
        o = accumulate(o, p.astype(q_smem.dtype), keys.at[:, pl.ds(part * chunk, chunk)])
        return o, m_new, l_

    o, m, l_ = lax.fori_loop(0, n_tiles, step, (o, m, l_))
    out = o / lax.broadcast_in_dim(l_, o.shape, [0])
    o_ref.at[b, s, heads, pl.ds(part * chunk, chunk)][...] = out.astype(o_ref.dtype)

    @pl.when(part == 0)
    def _():
        lse_ref.at[b, s, heads][...] = m + jnp.log(l_)


SMEM_BYTES = 232448  # H100 / H200: shared memory a CTA may take


def smem_bytes(h: int, n_keys: int, slots: int = 2) -> int:
    """The kernel's SMEM: Q, the key slots, the row list, the sink and Mosaic GPU's reduction scratch (2 KB),
    each aligned to 1 KB as Mosaic GPU places them. At H = 512 two slots fill it: Q 64 KB + 2 x 64 KB."""
    def kb(n):
        return -(-n // 1024) * 1024
    return kb(HEADS * h * 2) + kb(slots * KEYS * h * 2) + kb(n_keys * 4) + kb(HEADS * 4) + 2048


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "slots"))
def sparse_mqa(q: Float[Array, "B S N H"], main: Float[Array, "B T H"], extra: Float[Array, "B E H"],
               idx: Int[Array, "B S L"], sink: Float[Array | np.ndarray, "N"], scale: float, *, interpret: bool = False,
               slots: int = 2) -> tuple[Float[Array, "B S N H"], Float[Array, "B S N"]]:
    """``reference.sparse_mqa`` over the rows of ``main`` then ``extra`` (``layout.key_rows``) as a Mosaic GPU
    kernel. N is padded to a multiple of 64 heads (zero queries, sliced off), L must be a multiple of 64,
    H a multiple of 64 up to 512; q and the keys bf16 or f16 when compiled. ``slots`` key tiles in SMEM
    (``slots − 1`` gathers in flight; more than 2 fit only below H = 512)."""
    b, s, n, h = q.shape
    L = idx.shape[-1]
    if (L % KEYS or h % TILE[1] or h > 2 * MAX_CHUNK or idx.shape[:2] != (b, s)
            or main.shape[::2] != (b, h) or extra.shape[::2] != (b, h) or not 2 <= slots <= 3):
        raise ValueError(f"sparse_mqa kernel: q {q.shape}, keys {main.shape} + {extra.shape}, idx {idx.shape}: "
                         f"needs L a multiple of {KEYS}, H a multiple of {TILE[1]} up to {2 * MAX_CHUNK}, and "
                         f"matching B, S, H; 2 or 3 key slots (got {slots})")
    if smem_bytes(h, L, slots) > SMEM_BYTES:
        raise ValueError(f"sparse_mqa kernel: {slots} key slots of {KEYS} x {h} and a row list of {L} need "
                         f"{smem_bytes(h, L, slots)} bytes of SMEM, more than a CTA has ({SMEM_BYTES})")
    if not interpret and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"sparse_mqa kernel: q must be bf16 or f16 on the GPU, got {q.dtype}")
    npad = -n % HEADS
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, npad), (0, 0)))
    sinkp = jnp.pad(sink.astype(jnp.float32), (0, npad))
    chunk = min(h, MAX_CHUNK)
    n_wg = h // chunk
    tf = _smem_transforms(interpret)
    kw = dict(interpret=ms.interpret_params()) if interpret else {}
    scratch = [plgpu.SMEM((HEADS, h), q.dtype, transforms=tf), plgpu.SMEM((slots, KEYS, h), q.dtype, transforms=tf),
               plgpu.SMEM((L // KEYS, KEYS), jnp.int32), plgpu.SMEM((HEADS,), jnp.float32),
               plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=n_wg)]
    kernel = plgpu.kernel(
        functools.partial(_body, scale=scale, n_wg=n_wg, chunk=chunk, slots=slots, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct(qp.shape[:3], jnp.float32)),
        scratch_types=scratch,
        grid=(b * s, (n + npad) // HEADS), grid_names=("q", "g"), num_threads=n_wg, thread_name="wg", **kw)
    idx = idx.astype(jnp.int32).reshape(b, s, L // KEYS, KEYS)
    out, lse = kernel(qp, main.astype(q.dtype), extra.astype(q.dtype), idx, sinkp)
    return out[:, :, :n], lse[:, :, :n]
