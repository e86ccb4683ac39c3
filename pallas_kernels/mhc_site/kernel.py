"""An mHC site of a decode step as one Pallas (Triton) kernel (spec model §4.3–§4.4).

Between two sublayers the single-pass schedule does, per row: ``X' = expand(F, X, post, comb)`` (the last
sublayer's output mixed into the M streams), the next coefficients' raw mixes ``RMS-normalised flat(X')·fnᵀ``
and ``u = collapse(X', pre)`` with the ``pre`` predicted one site earlier. At decode these are a few rows of
M·D values and a [(2+M)·M, M·D] fp32 matrix: XLA:GPU runs them as ~7 dependent kernels of a few µs each
(expand, the squares' sum, the matvec as a GEMM, collapse, ...; ``benchmarks/decode_forms.py``), so a site
costs the kernels' latency, not its bytes (~0.8 MB at the engine-bench width). No library kernel fuses this
mix of a batched elementwise map, a matvec and two reductions, hence this one.

The grid splits D into chunks (and the rows into blocks of up to 32): each program expands its columns of
every stream, writes them, adds their squares and their products with ``fn``'s columns into per-chunk
partial sums, and writes its columns of ``u``. The partials (``[chunks, Y + 1, rows]``: Y mixes, then the
squares) are summed in XLA with the coefficients that follow (:func:`dsv41_jax.model.mhc.coefficients`),
one fusion. Arithmetic as :mod:`dsv41_jax.model.mhc`: fp32 mixing, the expanded streams rounded to the
residual's dtype before the mixes and collapse read them; only the summation order of the matvec and the
squares differs (chunked), which moves the mixes by fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

ROW_BLOCK = 32
MAX_CHUNK = 64


def _chunk(rows: int) -> int:
    """Columns a program takes: wider for few rows (each program's registers hold ~7 [rows, chunk] tiles)."""
    return MAX_CHUNK if rows <= 8 else MAX_CHUNK // 2


def _kernel(f_ref, x_ref, post_ref, comb_ref, pre_ref, fn_ref, xo_ref, u_ref, part_ref, *, m: int, y: int,
            chunk: int, rb: int, expand: bool):
    c, b = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    rows = pl.ds(pl.multiple_of(b * rb, rb), rb)
    f32 = jnp.float32
    xs = [x_ref[rows, i, cols].astype(f32) for i in range(m)]
    if expand:
        ff = f_ref[rows, cols].astype(f32)
    squares = jnp.zeros((rb,), f32)
    u = jnp.zeros((rb, chunk), f32)
    mixes = [jnp.zeros((rb,), f32) for _ in range(y)]
    for j in range(m):
        if expand:  # X'_j = post_j·F + Σ_i comb[i, j]·X_i, summed in this order (mhc.expand's)
            xj = post_ref[rows, j][:, None] * ff
            for i in range(m):
                xj = xj + comb_ref[rows, i * m + j][:, None] * xs[i]
            xj = xj.astype(xo_ref.dtype)
            xo_ref[rows, j, cols] = xj
            xj = xj.astype(f32)
        else:
            xj = xs[j]
        squares = squares + jnp.sum(xj * xj, axis=1)
        u = u + pre_ref[rows, j][:, None] * xj
        for k in range(y):
            mixes[k] = mixes[k] + jnp.sum(xj * fn_ref[k, j, cols][None, :], axis=1)
    u_ref[rows, cols] = u.astype(u_ref.dtype)
    for k in range(y):
        part_ref[c, k, rows] = mixes[k]
    part_ref[c, y, rows] = squares


@functools.partial(jax.jit, static_argnames=("norm_eps", "interpret"))
def fused_site(
    f: Float[Array, "R D"] | None, x: Float[Array, "R M D"], post: Float[Array, "R M"] | None,
    comb: Float[Array, "R M M"] | None, pre: Float[Array, "R M"], fn: Float[Array, "Y MD"], norm_eps: float,
    interpret: bool = False,
) -> tuple[Float[Array, "R M D"], Float[Array, "R D"], Float[Array, "R Y"]]:
    """``(X', u, mix)``: ``X' = expand(f, x, post, comb)`` (``x`` itself when ``f`` is None: a block's first
    site), ``u = collapse(X', pre)`` (not normalised) and the raw mixes ``mix_logits(X', fn)``.

    ``interpret`` runs the kernel in the Pallas interpreter (CPU tests)."""
    expand = f is not None
    r, m, d = x.shape
    y = fn.shape[0]
    if fn.shape[1] != m * d:
        raise ValueError(f"fused_site: fn is {fn.shape}, expected [Y, {m * d}] for streams x {x.shape}")
    padded = max(1, 1 << (r - 1).bit_length())  # Triton tiles: powers of two
    rb = min(padded, ROW_BLOCK)
    padded = -(-padded // rb) * rb
    chunk = _chunk(rb)
    if d % chunk:
        raise ValueError(f"fused_site: the width {d} is not a multiple of {chunk}")

    def pad(a):
        return jnp.pad(a, [(0, padded - r)] + [(0, 0)] * (a.ndim - 1))

    f32 = jnp.float32
    if not expand:  # unused operands, never read
        f, post, comb = x[:, 0], pre, jnp.zeros((r, m * m), f32)
    args = (pad(f), pad(x), pad(post.astype(f32)), pad(comb.reshape(r, m * m).astype(f32)), pad(pre.astype(f32)),
            fn.reshape(y, m, d).astype(f32))
    kernel = functools.partial(_kernel, m=m, y=y, chunk=chunk, rb=rb, expand=expand)
    chunks = d // chunk
    xo, u, part = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((padded, m, d), x.dtype), jax.ShapeDtypeStruct((padded, d), x.dtype),
                   jax.ShapeDtypeStruct((chunks, y + 1, padded), f32)),
        grid=(chunks, padded // rb),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="mhc_site",
    )(*args)
    part = part.sum(0)[:, :r]  # [Y + 1, R]
    mix = part[:y].T * jax.lax.rsqrt(part[y] / (m * d) + norm_eps)[:, None]
    return (xo[:r] if expand else x), u[:r], mix


def reference_site(f, x, post, comb, pre, fn, norm_eps: float):
    """:func:`fused_site`'s result from the model's own functions."""
    from dsv41_jax.model import mhc

    if f is not None:
        x = mhc.expand(f[:, None], x[:, None], post[:, None], comb[:, None])[:, 0]
    u = mhc.collapse(x[:, None], pre[:, None])[:, 0]
    return x, u, mhc.mix_logits(x[:, None], fn, norm_eps)[:, 0]
