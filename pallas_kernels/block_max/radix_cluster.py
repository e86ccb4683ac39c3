"""The radix select's whole threshold search (``select.kth_largest_key``) in one Mosaic GPU kernel: a
cluster of CTAs per row, its keys read from HBM once and kept in SMEM for every pass.

``radix_mosaic`` launches a kernel a pass, and each CTA there counts its keys against 15 thresholds; when a
CTA holds several tiles (many rows, or long ones) that count is slow on the H200 (~33 µs a pass at 32 x
131072 keys, BENCHMARKS.md). Here the row's C CTAs form a thread-block cluster (C <= 8, the portable size),
so the passes synchronise inside the kernel: each CTA counts its keys against the pass's threshold, stores
its count in its own SMEM, the cluster synchronises, and every thread adds the C counts through distributed
shared memory. Nothing goes back to HBM until the threshold, and a pass is one compare per key: 32 passes
of one bit (2- and 4-bit digits, 16 and 8 passes of 3 and 15 compares, were slower on the H200;
BENCHMARKS.md). ``select`` takes this kernel where the per-pass kernels would give a CTA several tiles.

Layout: the block maxima [R, N] (f32) are read as int32 bits, [R * C * T * 128, P] rows of P = 32 (CTA
(r, c) owns T tiles of 128 rows, one row a thread in registers, ``mosaic_stream.rows_layout``); padding is
-1, the bits of a NaN that maps to the lowest key. After the load each CTA rewrites its tiles in SMEM as the
signed order key (``radix_mosaic.signed_key``).

Interpreted (CPU), the exchange goes through a GMEM buffer and a ``plgpu.ClusterBarrier``: the GPU
interpreter has neither distributed shared memory nor inline PTX. Compiled, the exchange is inline PTX
(:func:`_exchange_sum`): Mosaic GPU lowers no access to a peer's SMEM in jax 0.11.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms
from pallas_kernels.block_max.radix_mosaic import pack_pairs, signed_key, to_kernel_rows, unpack_pairs

P = 32  # keys per thread row (128 bytes)
TILE = 128 * P  # keys per TMA tile
OUT = 128  # int32 per exchanged vector: the pass's counts at its first lanes
MAX_CLUSTER = 8  # the portable cluster size
MAX_TILES_PER_CTA = 12  # 16 KB each in SMEM, all resident: <= 49152 keys a CTA
DIGIT_BITS = 1  # 32 passes of one count (see the module doc)
CLUSTER_AXIS, ROW_AXIS = "cl", "row"
_SIGN = -(1 << 31)


def _i32(v: int) -> int:
    """A 32-bit pattern as a Python int in int32's range."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def geometry(n: int, ctas: int | None = None) -> tuple[int, int] | None:
    """(CTAs per row C, tiles per CTA T) for rows of N keys, or None when a row does not fit one cluster's
    SMEM (more than 8 x 12 x 4096 keys). Every row is spread over as many CTAs as the cluster allows
    (``ctas``, at most 8, caps it)."""
    if ctas is not None and not 1 <= ctas <= MAX_CLUSTER:
        raise ValueError(f"radix_cluster: ctas must be in [1, {MAX_CLUSTER}], got {ctas}")
    tiles = -(-n // TILE)
    c = max(1, min(tiles, ctas or MAX_CLUSTER))
    t = -(-tiles // c)
    return None if t > MAX_TILES_PER_CTA else (c, t)


def supports(n: int, interpret: bool = False) -> bool:
    """Whether rows of N keys fit one cluster (interpreted on jax < 0.11: one CTA, see :func:`max_ctas`)."""
    return geometry(n, max_ctas(interpret)) is not None


def max_ctas(interpret: bool) -> int | None:
    """The cluster size cap: none compiled; interpreted, 1 on jax < 0.11, whose GPU interpreter has no
    cluster barriers."""
    return 1 if interpret and jax.__version_info__ < (0, 11) else None


def _exchange_sum(xbuf, vec, slot: int, c: int, layout):
    """The cluster-wide sum of ``vec`` [OUT] (one element a thread), compiled path: each thread stores its
    element into this CTA's ``xbuf[slot]``, the cluster synchronises (``barrier.cluster`` arrive with
    release, wait with acquire, by every thread), and each thread adds the same element of the C CTAs'
    buffers through distributed shared memory (``mapa`` + ``ld.shared::cluster``). Inline PTX: Mosaic GPU
    lowers no vector or scalar access to a peer's SMEM in jax 0.11."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, llvm
    from jaxlib.mlir.dialects import vector as vector_d

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), layout),
                       return_type=plgpu.ShapeDtypeStruct((OUT,), jnp.int32, layout=layout))
    def exchange(ctx, ref, arr):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        regs = arr.registers
        if regs.size != 1 or ir.VectorType(regs.flat[0].type).shape != [1]:
            raise NotImplementedError(f"radix_cluster: expected one element a thread, got registers {regs.shape}")
        tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mu.c(OUT, i32))
        base = llvm.ptrtoint(i32, mu.memref_ptr(ref))
        addr = arith.addi(base, arith.muli(arith.addi(tid, mu.c(slot * OUT, i32)), mu.c(4, i32)))
        val = llvm.extractelement(regs.flat[0], mu.c(0, i32))
        loads = "".join(f"mapa.shared::cluster.u32 a, $1, {ci};\nld.shared::cluster.u32 v, [a];\n"
                        f"add.u32 s, s, v;\n" for ci in range(c))
        asm = ("{\n.reg .b32 a, v, s;\nst.shared.u32 [$1], $2;\nbarrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\nmov.u32 s, 0;\n" + loads + "mov.u32 $0, s;\n}")
        total = llvm.inline_asm(i32, [addr, val], asm, "=r,r,r,~{memory}", has_side_effects=True)
        out = vector_d.broadcast(regs.flat[0].type, total)
        return fa.FragmentedArray(_registers=np.full(regs.shape, out, dtype=object),
                                  _layout=arr.layout, _is_signed=True)

    return exchange(xbuf, vec)


@functools.partial(jax.jit, static_argnames=("c", "t", "interpret"))
def search(rows, k, *, c: int, t: int, interpret: bool = False):
    """``rows`` from ``radix_mosaic.to_kernel_rows``, ``k`` int32 [1] -> [R, OUT] int32: every lane the row's
    k-th largest key (``select.order_key`` bits as int32)."""
    r = rows.shape[0] // (c * t * 128)
    bits = DIGIT_BITS
    bins = 1 << bits
    shifts = list(range(32 - bits, -1, -bits))

    def body(x_gmem, k_gmem, *refs):
        if interpret:
            out_gmem, xch_gmem, keys, o_buf, barrier, *cbar = refs
            cbar = cbar[0] if cbar else None
        else:
            out_gmem, keys, o_buf, xbuf, barrier = refs
        row = lax.axis_index(ROW_AXIS)
        me = lax.axis_index(CLUSTER_AXIS)
        base = (row * c + me) * t
        for i in range(t):
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds((base + i) * 128, 128)], keys.at[i], barrier.at[i])
        reg = ms.rows_layout(P)
        for i in range(t):  # the signed order key, in place
            plgpu.barrier_wait(barrier.at[i])
            x = signed_key(keys[i] if interpret else ms.load(keys.at[i], reg))
            if interpret:
                keys[i] = x
            else:
                keys.at[i][...] = x
        kk = k_gmem[0]
        if interpret:
            lane = lax.broadcasted_iota(jnp.int32, (OUT,), 0)
        else:
            lane = plgpu.broadcasted_iota(jnp.int32, (OUT,), 0, layout=reg.reduce(1))
        prefix = jnp.int32(0)
        for p, shift in enumerate(shifts):
            thresholds = [(prefix | _i32(j << shift)) ^ _SIGN for j in range(1, bins)]
            if interpret:
                counts = [sum(jnp.sum((keys[i] >= th).astype(jnp.int32)) for i in range(t)) for th in thresholds]
            else:
                acc = None
                for i in range(t):
                    x = ms.load(keys.at[i], reg)
                    hits = [jnp.sum((x >= th).astype(jnp.int32), axis=1) for th in thresholds]
                    acc = hits if acc is None else [a + h for a, h in zip(acc, hits, strict=True)]
                counts = unpack_pairs([jnp.sum(w) for w in pack_pairs(acc)], bins - 1)
            vec = jnp.zeros((OUT,), jnp.int32) if interpret else jnp.where(lane < 0, 1, 0)
            for j, a in enumerate(counts):
                vec = jnp.where(lane == j, a, vec)
            slot = p % 2
            if interpret:
                xch_gmem[row, slot, me] = vec
                if c > 1:  # (jax 0.10's interpreter has no cluster barriers: single-CTA rows there)
                    plgpu.barrier_arrive(cbar)
                    plgpu.barrier_wait(cbar)
                total = sum(xch_gmem[row, slot, ci] for ci in range(c))
            else:
                total = _exchange_sum(xbuf, vec, slot, c, reg.reduce(1))
            digit = jnp.sum(jnp.where((lane < bins - 1) & (total >= kk), 1, 0))  # counts fall with the lane
            prefix = prefix | (digit << shift)

        @pl.when(me == 0)
        def _():
            if interpret:
                o_buf[...] = jnp.full((OUT,), prefix, jnp.int32)
            else:
                o_buf[...] = jnp.where(lane >= 0, prefix, 0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_buf, out_gmem.at[row])
            plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((r, OUT), jnp.int32)]
    scratch = [plgpu.SMEM((t, 128, P), jnp.int32), plgpu.SMEM((OUT,), jnp.int32)]
    if interpret:
        out_type.append(jax.ShapeDtypeStruct((r, 2, c, OUT), jnp.int32))
        scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=t))
        if c > 1:
            scratch.append(plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,)))
    else:
        scratch += [plgpu.SMEM((2, OUT), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=t)]
    kw = {"interpret": ms.interpret_params()} if interpret else {}
    out = plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch, grid=(r,), grid_names=(ROW_AXIS,),
                       cluster=(c,), cluster_names=(CLUSTER_AXIS,), **kw)(rows, k)
    return out[0]


def kth_largest_key(x, k: int, *, ctas: int | None = None, interpret: bool = False):
    """``select.kth_largest_key(select.order_key(x), k)`` for f32 rows ``x`` [R, N] (uint32 [R]) in one
    kernel. ``ctas`` overrides the CTAs a row (the cluster size). Raises if a row is too long for one
    cluster (:func:`supports`)."""
    r, n = x.shape
    geo = geometry(n, ctas)
    if geo is None:
        raise ValueError(f"radix_cluster: rows of {n} keys exceed the SMEM of a cluster of "
                         f"{ctas or MAX_CLUSTER} CTAs ({(ctas or MAX_CLUSTER) * MAX_TILES_PER_CTA * TILE} keys)")
    c, t = geo
    k_arr = jnp.full((1,), k, jnp.int32)  # traced: one compile for every k
    out = search(to_kernel_rows(x, c, t), k_arr, c=c, t=t, interpret=interpret)
    return lax.bitcast_convert_type(out[:, 0], jnp.uint32)
