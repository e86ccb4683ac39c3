"""block_max on GPU through Mosaic GPU (``plgpu.kernel``), the supported Pallas GPU path in jax 0.11.

A streaming max: each CTA runs ``mosaic_stream.stream`` over tiles of ``positions_per_step`` positions
of one score row (TMA in with ``stages`` slots, TMA out from two buffers). In registers a tile is a
[blocks, block_size] array with one block per thread (``mosaic_stream.rows_layout``), so the block max
stays inside the thread; the newest visible block ``(n_p - 1) // block_size`` (where n_p > 0) is set to
+inf by comparing an iota of block ids with n_p, read as a scalar from GMEM. ``top_k`` stays in XLA
(``api.candidate_block_ids``): Mosaic GPU has no sort / top_k lowering.

GMEM views (TMA boxes need an innermost extent of >= 16 bytes and <= 256 elements per dimension):
scores [R, Tp / K, K] and maxima [R, Tp / K, ko], with ko maxima per box row (ko * itemsize >= 16
bytes) and K = block_size * ko positions; Tp is T rounded up to whole tiles. Both are free reshapes when T
is a multiple of the tile (8192 positions by default). Otherwise XLA pads the scores with -inf up to Tp
(one extra copy of the input; -inf is the reference's own padding) and slices the maxima: no box overhangs
the arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_stream as ms

LAYOUTS = ("rows", "wgmma")


class _Geometry:
    def __init__(self, r: int, t: int, block_size: int, dtype, positions_per_step: int, chunk_blocks: int,
                 lay: str):
        itemsize = jnp.dtype(dtype).itemsize
        self.r, self.t, self.bs, self.layout = r, t, block_size, lay
        self.ko = max(16 // itemsize, -(-64 // block_size))  # maxima per output box row
        self.k = block_size * self.ko  # positions per input box row
        self.tp = -(-t // self.k) * self.k
        self.nbp = self.tp // block_size  # maxima per (padded) row
        unit = 128 if lay == "rows" else 64  # blocks per register-layout tile
        up = lambda v, m: -(-v // m) * m  # noqa: E731
        self.chunk = min(chunk_blocks, up(self.nbp, unit))  # blocks per register pass
        self.nbt = min(up(max(positions_per_step // block_size, 1), self.chunk), up(self.nbp, self.chunk))
        self.tt = self.nbt * block_size  # positions per tile
        problems = []
        if lay not in LAYOUTS:
            problems.append(f"layout must be one of {LAYOUTS}")
        if block_size % (4 if lay == "rows" else 8):
            problems.append(f"block_size ({block_size}) must be a multiple of {4 if lay == 'rows' else 8}")
        if self.tt % self.k or self.tt // self.k > 256:
            problems.append(f"positions per step ({self.tt}) must be a multiple of {self.k} and at most {256 * self.k}")
        if self.chunk % unit or self.nbt % self.chunk:
            problems.append(f"chunk_blocks ({self.chunk}) must be a multiple of {unit} dividing the blocks per "
                            f"step ({self.nbt})")
        if (self.nbt * itemsize) % 128:
            problems.append("blocks per step x itemsize must be a multiple of 128 bytes (SMEM alignment)")
        if problems:
            raise ValueError(f"block_max mosaic (T={t}, block_size={block_size}, positions_per_step="
                             f"{positions_per_step}, chunk_blocks={chunk_blocks}, layout={lay}): "
                             + "; ".join(problems))
        self.tiles_per_row = -(-self.tp // self.tt)
        # rows padded to whole tiles: no TMA box overhangs the middle axis of the [R, Tp / K, K] view. With
        # such overhangs the H200 returned 0.0 for blocks inside the row (2026-12-01, T = 37, 2053, 4099; an
        # overhang of the leading axis, as fp4_pack's last row tile has, is exact there)
        self.tp = self.tiles_per_row * self.tt
        self.nbp = self.tp // block_size
        self.n_tiles = r * self.tiles_per_row
        self.rows_out = self.nbp

    def reg_layout(self):
        return ms.rows_layout(self.bs) if self.layout == "rows" else plgpu.Layout.WGMMA


def _body(geo: _Geometry, interpret: bool, n_ctas: int, stages: int):
    kb, kbo = geo.tt // geo.k, geo.nbt // geo.ko  # box rows per tile (input, output): equal

    def body(n_gmem, s_gmem, o_gmem, s_buf, o_buf, barrier):
        def where(t):
            return t // geo.tiles_per_row, t % geo.tiles_per_row

        def load(t, slot):
            i, j = where(t)
            dst = s_buf.at[slot] if interpret else s_buf.at[slot].reshape(1, kb, geo.k)
            plgpu.copy_gmem_to_smem(s_gmem.at[pl.ds(i, 1), pl.ds(j * kb, kb)], dst, barrier.at[slot])

        def store(t, buf):
            i, j = where(t)
            plgpu.copy_smem_to_gmem(o_buf.at[buf], o_gmem.at[pl.ds(i, 1), pl.ds(j * kbo, kbo)])

        def finish(bmax, blk, n):
            pinned = (blk == lax.div(n - 1, geo.bs)) & (n > 0)  # truncation at n = 0 is masked by n > 0
            return jnp.where(pinned, jnp.asarray(jnp.inf, bmax.dtype), bmax)

        def compute(t, slot, buf):
            i, j = where(t)
            n = n_gmem[i]
            if interpret:  # whole tile, value reshapes (no ref reshapes or layouts in the interpreter)
                bmax = jnp.max(s_buf[slot].reshape(geo.nbt, geo.bs), axis=1)  # [1, kb, k] there
                blk = j * geo.nbt + lax.broadcasted_iota(jnp.int32, (geo.nbt,), 0)
                o_buf[buf] = finish(bmax, blk, n).reshape(o_buf.shape[1:])
                return
            reg = geo.reg_layout()
            ss = s_buf.at[slot]  # [nbt, bs]: declared so, so that no ref reshape splits its minor dimension
            os_ = o_buf.at[buf].reshape(geo.nbt)

            def one_chunk(c, carry):
                sl = pl.ds(c * geo.chunk, geo.chunk)
                bmax = jnp.max(ms.load(ss.at[sl], reg), axis=1)
                blk = (j * geo.nbt + c * geo.chunk
                       + plgpu.broadcasted_iota(jnp.int32, (geo.chunk,), 0, layout=reg.reduce(1)))
                os_.at[sl][...] = finish(bmax, blk, n)
                return carry

            lax.fori_loop(0, geo.nbt // geo.chunk, one_chunk, 0)

        ms.stream(n_tiles=geo.n_tiles, n_ctas=n_ctas, stages=stages, barrier=barrier,
                  load=load, compute=compute, store=store)

    return body


@functools.partial(jax.jit, static_argnames=("block_size", "positions_per_step", "chunk_blocks", "stages",
                                             "ctas_per_sm", "layout_name", "no_auto_barriers", "interpret"))
def block_max(scores, n_visible, block_size: int, *, positions_per_step: int = 8192, chunk_blocks: int = 512,
              stages: int = 3, ctas_per_sm: int = 2, layout_name: str = "rows", no_auto_barriers: bool = False,
              interpret: bool = False):
    """[B, S, T] scores, [B, S] n_p -> [B, S, ceil(T / block_size)] maxima, equal to reference.block_max.

    Tuning (all static): ``positions_per_step`` positions per TMA tile, ``chunk_blocks`` blocks per
    register pass (a multiple of 128 for ``layout_name="rows"``, 64 for ``"wgmma"``), ``stages`` input
    slots per CTA, ``ctas_per_sm`` resident CTAs per SM, ``no_auto_barriers`` as in fp4_pack.mosaic.pack.
    ``interpret=True`` runs the GPU interpreter (CPU; no register layouts).
    """
    b, s, t = scores.shape
    nb = -(-t // block_size)
    r = b * s
    if r == 0 or t == 0:
        return jnp.full((b, s, nb), -jnp.inf, scores.dtype)
    geo = _Geometry(r, t, block_size, scores.dtype, positions_per_step, chunk_blocks, layout_name)
    x = scores.reshape(r, t)
    if geo.tp != t:  # one copy: -inf is the reference's padding
        x = jnp.pad(x, ((0, 0), (0, geo.tp - t)), constant_values=-jnp.inf)
    x = x.reshape(r, geo.tp // geo.k, geo.k)
    n_ctas = min(geo.n_tiles, ctas_per_sm * ms.num_sms())
    kb = geo.tt // geo.k
    scratch = [
        # compiled: [nbt, bs] per slot (the register load's view; TMA writes it through a reshape to the
        # box [1, kb, k]); interpreted: the box shape (the interpreter has no ref reshapes)
        plgpu.SMEM((stages, 1, kb, geo.k) if interpret else (stages, geo.nbt, geo.bs), scores.dtype),
        plgpu.SMEM((2, 1, kb, geo.ko), scores.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    ]
    out_type = jax.ShapeDtypeStruct((r, geo.rows_out // geo.ko, geo.ko), scores.dtype)
    out = ms.kernel(_body(geo, interpret, n_ctas, stages), out_type=out_type, scratch_types=scratch,
                    n_ctas=n_ctas, interpret=interpret, no_auto_barriers=no_auto_barriers)(
        n_visible.reshape(r).astype(jnp.int32), x)
    return out.reshape(r, geo.rows_out)[:, :nb].reshape(b, s, nb)
