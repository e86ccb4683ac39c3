"""Decode attention straight from the packed caches, split over the keys: one Pallas (Triton) kernel for GPU.

A decode step's query (one token, ``N`` heads sharing the ``H``-wide latent, K = V) attends to its own SWA row,
the layer's SWA ring (FP8 E4M3 values with a UE8M0 scale per 32 lanes, ``W`` slots) and the ≤ ``K`` compressed
entries its index source picked (E2M1 nibbles with an E4M3 scale per 16 lanes, gathered by row), with the
per-head sink in the denominator (spec attention §3.6, §7). The XLA path unpacks the ring and the picked rows
to bf16 in HBM, then runs a few dependent kernels over ~640 keys; at batch 1 that is one small program per step
of the GPU's time, latency rather than bytes. The Mosaic kernel (``mosaic.py``) runs a CTA per query, which
leaves most of the GPU idle below ~64 queries. No library kernel reads these cache formats, hence this one.

Flash-decoding: the key tiles (ring tiles first, then pick tiles, ``block`` keys each) are split into
``splits`` ranges; a program takes one sequence, ``heads`` query heads and one range, decodes each tile's
rows in registers (gathered by slot or by pick), and keeps an online softmax over its range. It writes its
running max, denominator and unnormalised output; :func:`sparse_decode` merges the ranges with the sink and the
query's own row (a bf16 key of this step, never in the cache) in XLA.

Rows are read as 32-bit words, not bytes: a code word holds the 8 nibbles of lanes 8w .. 8w + 7, two ring words
the 8 E4M3 bytes of the same lanes; the scale bytes are gathered one a word. Each tile is decoded into 8 phases
(phase p: lanes 8w + p, w = 0 .. H/8 − 1), the query is split into the same 8 phases outside the kernel, the
logits are the sum of 8 products of H/8 lanes, and the output comes back as 8 phases, interleaved in XLA. (The
first form of this kernel loaded a byte a lane for the codes and for each lane's scale, then the even and odd
lanes apart: on the H200 it ran 33–41 µs at batch 1 and 170–515 µs at batch 32 against XLA's 22 and 74.)

Numerics: the decoded values are exact in bf16 (E2M1 × E4M3 has ≤ 6 significant bits, E4M3 × 2^k ≤ 4), logits
are fp32 sums of bf16 products as in XLA; probabilities are rounded to bf16 before P·V against the tile's own
max rather than the global one, which moves the output within bf16 rounding of the reference (as the Mosaic
kernel's online softmax does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int, Shaped, UInt8

from pallas_kernels.fp4_pack.decode import e2m1_value, e4m3_value, e8m0_value
from pallas_kernels.fp4_pack.layout import as_bytes

SWA_GROUP, MAIN_GROUP = 32, 16  # lanes per scale: the ring's UE8M0, the main KV's E4M3 (spec §7.1, §7.2)


PHASES = 8  # lanes a pair of 32-bit words carries: 8 E2M1 nibbles of a code word, 8 E4M3 bytes of two ring words


def _kernel(meta_ref, q_ref, rv_ref, re_ref, rpos_ref, codes_ref, scales_ref, topk_ref,
            m_ref, l_ref, acc_ref, *, heads: int, block: int, window: int, picks: int, entries: int,
            ring_tiles: int, per_split: int, tiles: int, scale: float):
    b, hb, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hs = pl.ds(hb * heads, heads)
    qs = [q_ref[b, ph, hs, :] for ph in range(PHASES)]  # [heads, H/8]: lanes 8w + ph
    dt = qs[0].dtype
    words = jnp.arange(qs[0].shape[-1])  # w: lanes 8w .. 8w + 7
    qpos, floor = meta_ref[b, 0], meta_ref[b, 1]

    def attend(carry, keys, ok):
        m, den, *acc = carry
        s = sum(jnp.dot(q, k.T, preferred_element_type=jnp.float32) for q, k in zip(qs, keys, strict=True))
        s = jnp.where(ok[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a head with no visible key yet
        alpha = jnp.exp(m - base)
        p = jnp.exp(s - base[:, None])
        pb = p.astype(dt)
        acc = [a * alpha[:, None] + jnp.dot(pb, k, preferred_element_type=jnp.float32)
               for a, k in zip(acc, keys, strict=True)]
        return (m_new, den * alpha + jnp.sum(p, axis=1), *acc)

    def ring_tile(t, carry):
        slot = t * block + jnp.arange(block)
        inside = slot < window
        slot = jnp.minimum(slot, window - 1)
        kp = rpos_ref[b, slot]
        ok = inside & (kp >= 0) & (kp > qpos - window) & (kp >= floor)
        rows = slot[:, None]
        # lanes 8w .. 8w + 7 are the bytes of words 2w (lanes 8w .. 8w + 3) and 2w + 1; one E8M0 scale per 32 lanes
        pair = (rv_ref[b, rows, 2 * words[None, :]], rv_ref[b, rows, 2 * words[None, :] + 1])
        sc = e8m0_value(re_ref[b, rows, (words // (SWA_GROUP // PHASES))[None, :]].astype(jnp.int32))
        keys = [(e4m3_value((pair[ph // 4] >> (8 * (ph % 4))) & 0xFF) * sc).astype(dt) for ph in range(PHASES)]
        return attend(carry, keys, ok)

    def pick_tile(t, carry):
        i = t * block + jnp.arange(block)
        inside = i < picks
        idx = topk_ref[b, jnp.minimum(i, picks - 1)]
        ok = inside & (idx >= 0)
        rows = jnp.clip(idx, 0, entries - 1)[:, None]  # as XLA's gather clamps: no load past the cache
        code = codes_ref[b, rows, words[None, :]]  # [block, H/8] int32: the 8 nibbles of lanes 8w .. 8w + 7
        sc = e4m3_value(scales_ref[b, rows, (words // (MAIN_GROUP // PHASES))[None, :]].astype(jnp.int32))
        keys = [(e2m1_value((code >> (4 * ph)) & 0xF) * sc).astype(dt) for ph in range(PHASES)]
        return attend(carry, keys, ok)

    t0 = j * per_split
    t1 = jnp.minimum(t0 + per_split, tiles)
    half = qs[0].shape
    carry = (jnp.full((heads,), -jnp.inf, jnp.float32), jnp.zeros((heads,), jnp.float32),
             *[jnp.zeros(half, jnp.float32) for _ in range(PHASES)])
    carry = jax.lax.fori_loop(jnp.minimum(t0, ring_tiles), jnp.minimum(t1, ring_tiles), ring_tile, carry)
    carry = jax.lax.fori_loop(jnp.maximum(t0, ring_tiles) - ring_tiles, jnp.maximum(t1, ring_tiles) - ring_tiles,
                              pick_tile, carry)
    m, den, *acc = carry
    m_ref[b, j, hs] = m
    l_ref[b, j, hs] = den
    for ph in range(PHASES):
        acc_ref[b, j, ph, hs, :] = acc[ph]


def _words(x):
    """A byte array [..., L] viewed as little-endian int32 words [..., L/4] (byte 0 in bits 0–7): a free bitcast."""
    x = as_bytes(x)
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.int32)


def pick_splits(batch: int, head_blocks: int, tiles: int, target: int = 264) -> int:
    """Key ranges a sequence is split into: enough programs to fill a GPU (about two per SM of an H100/H200),
    no more ranges than tiles."""
    return max(1, min(tiles, -(-target // (batch * head_blocks))))


@functools.partial(jax.jit, static_argnames=("window", "heads", "block", "splits", "num_warps", "interpret"))
def sparse_decode(
    q: Float[Array, "B 1 N H"],
    own_kv: Float[Array, "B 1 H"],
    sink: Float[Array, "N"],
    window: int,
    ring_values: Shaped[Array, "B W H"],
    ring_exps: UInt8[Array, "B W G"],
    ring_pos: Int[Array, "B W"],
    kv_codes: UInt8[Array, "B T P"] | None,
    kv_scales: Shaped[Array, "B T C"] | None,
    topk: Int[Array, "B 1 K"] | None,
    start: Int[Array, "B"],
    floor: Int[Array, "B"],
    *,
    heads: int = 16,
    block: int = 32,
    splits: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> Float[Array, "B 1 N H"]:
    """:func:`dsv41_jax.model.sparse.sparse_attention` of a one-token chunk at position ``start`` over the packed
    ring (slots at ``ring_pos``, −1 empty) and the picked rows ``topk`` (−1 empty) of the packed main KV, with the
    window floor ``floor`` (bounded replay): the same result within bf16 rounding of P.

    The byte arrays are the caches' own (``float8_e4m3fn`` passed as ``uint8``). ``kv_codes``, ``kv_scales`` and
    ``topk`` are None for a layer without compressed entries. ``interpret`` runs the kernel in the Pallas
    interpreter (CPU tests)."""
    b, s, n, h = q.shape
    if s != 1:
        raise ValueError(f"sparse_decode: one query row per sequence, got {s}")
    if h % (2 * SWA_GROUP) or ring_values.shape[-1] != h or ring_exps.shape[-1] != h // SWA_GROUP:
        raise ValueError(f"sparse_decode: ring {ring_values.shape} / {ring_exps.shape} does not match head dim {h}")
    if n % heads:
        raise ValueError(f"sparse_decode: {n} heads are not a multiple of the head block {heads}")
    slots = ring_values.shape[1]
    if topk is None:  # an SWA-only layer: no pick tiles (the arrays below are never read)
        kv_codes = jnp.zeros((b, 1, h // 2), jnp.uint8)
        kv_scales = jnp.zeros((b, 1, h // MAIN_GROUP), jnp.uint8)
        picks, topk2 = 0, jnp.full((b, 1), -1, jnp.int32)
    else:
        picks, topk2 = topk.shape[-1], topk[:, 0]
    ring_tiles, pick_tiles = -(-slots // block), -(-picks // block)
    tiles = ring_tiles + pick_tiles
    head_blocks = n // heads
    splits = pick_splits(b, head_blocks, tiles) if splits is None else min(splits, tiles)
    per_split = -(-tiles // splits)
    splits = -(-tiles // per_split)
    scale = h ** -0.5
    kernel = functools.partial(_kernel, heads=heads, block=block, window=window, picks=picks,
                               entries=kv_codes.shape[1], ring_tiles=ring_tiles, per_split=per_split, tiles=tiles,
                               scale=scale)
    f32 = jnp.float32
    meta = jnp.stack([start, floor], axis=1).astype(jnp.int32)
    qv = q[:, 0]
    phases = qv.reshape(b, n, h // PHASES, PHASES).transpose(0, 3, 1, 2)  # [B, 8, N, H/8]: lane 8w + ph
    m, den, acc = pl.pallas_call(
        kernel,
        out_shape=(*[jax.ShapeDtypeStruct((b, splits, n), f32)] * 2,
                   jax.ShapeDtypeStruct((b, splits, PHASES, n, h // PHASES), f32)),
        grid=(b, head_blocks, splits),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name="packed_decode",
    )(meta, phases, _words(ring_values), as_bytes(ring_exps), ring_pos.astype(jnp.int32), _words(kv_codes),
      as_bytes(kv_scales), topk2.astype(jnp.int32))
    acc = acc.transpose(0, 1, 3, 4, 2).reshape(b, splits, n, h)  # back to lane order
    # merge the ranges, the sink and the query's own row (visible unless the window floor is above it)
    own = own_kv[:, 0]
    l_own = jnp.einsum("bnh,bh->bn", qv, own.astype(q.dtype), preferred_element_type=f32) * scale
    l_own = jnp.where((start >= floor)[:, None], l_own, -jnp.inf)
    sk = sink.astype(f32)[None, :]
    mx = jnp.maximum(jnp.maximum(sk, l_own), m.max(axis=1))  # [B, N]
    w = jnp.exp(m - mx[:, None])  # [B, splits, N]
    p_own = jnp.exp(l_own - mx)
    den = jnp.exp(sk - mx) + p_own + (w * den).sum(1)
    acc = (w[..., None] * acc).sum(1)
    acc = acc + p_own.astype(q.dtype).astype(f32)[..., None] * own.astype(q.dtype).astype(f32)[:, None, :]
    return (acc / den[..., None]).astype(q.dtype)[:, None]
