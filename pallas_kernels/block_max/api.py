"""block_max: per-block maxima of the causally masked indexer scores with the newest block pinned, and
the candidate block ids built from them (spec attention §6.1): ``indexer.candidate_block_ids`` is this
function with the model's ``kernel_backend``.

The pass over the scores [B, S, T] is the kernel; ``lax.top_k`` over the [B, S, T / block_size] maxima
stays in XLA (no Pallas lowering of top_k on GPU). ``backend="xla"`` is the reference;
``backend="pallas"`` picks Mosaic GPU on GPU (``mosaic.py``), Mosaic TPU on TPU (``tpu.py``), and the
TPU kernel in interpret mode on CPU (for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.block_max import mosaic, reference, select, tpu

BACKENDS = ("xla", "pallas")


def block_max(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], block_size: int, *,
              backend: str = "xla") -> Float[Array, "B S NB"]:
    """Block maxima (−∞ padded tail), block ``(n_p − 1) // block_size`` set to +∞ where n_p > 0."""
    if backend not in BACKENDS:
        raise ValueError(f"block_max: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return reference.block_max(scores, n_visible, block_size)
    platform = jax.default_backend()
    if platform == "gpu":
        return mosaic.block_max(scores, n_visible, block_size)
    return tpu.block_max(scores, n_visible, block_size, interpret=platform != "tpu")


SELECTIONS = ("auto", "top_k", "radix", "radix_kernel", "radix_passes", "radix_cluster")
# "auto" takes the radix select from this many blocks per row: on the H200 it was 2.8x faster than top_k at
# 131072 blocks x 8 rows, 5.6x at x 32 rows and 1.5x at 16384 blocks x 128 rows (BENCHMARKS.md); below
# 16384 blocks a row, top_k's sort fits one kernel and was not measured against it
RADIX_MIN_BLOCKS = 16384


def candidate_block_ids(scores: Float[Array, "B S T"], n_visible: Int[Array, "B S"], block_size: int,
                        n_blocks: int, *, backend: str = "xla", selection: str = "auto") -> Int[Array, "B S K"]:
    """Per query, the top ``n_blocks`` blocks by block max (newest visible block pinned), dropping blocks
    with no visible score; ascending, −1 padded. Ties go to the lower block index (``lax.top_k``, spec §6.3).
    ``selection="radix"`` finds the same blocks without a sort (``select.select_top_blocks``);
    ``"auto"`` uses it from ``RADIX_MIN_BLOCKS`` blocks per row, else ``top_k``. With ``backend="pallas"``
    on GPU the radix search runs its passes as Mosaic GPU kernels (``radix_mosaic``).
    """
    # the ids are discrete: no gradient flows back, and pallas_call need not be differentiated when the
    # scores carry one (the indexer's own loss differentiates them)
    scores = jax.lax.stop_gradient(scores)
    bmax = block_max(scores, n_visible, block_size, backend=backend)  # [B, S, NB]
    return select_blocks(bmax, n_blocks, selection=selection, backend=backend)


# selection -> select.select_top_blocks's kernel
_RADIX_KERNEL = {"radix": None, "radix_kernel": "auto", "radix_passes": "passes", "radix_cluster": "cluster"}


def select_blocks(bmax: Float[Array, "*B NB"], n_blocks: int, *, selection: str = "auto",
                  backend: str = "xla") -> Int[Array, "*B K"]:
    """The candidate ids from block maxima: the top ``n_blocks`` (lower index first on ties) with a maximum
    above −∞, ascending, −1 padded. ``selection="radix_kernel"`` is the radix select with its threshold
    search in Mosaic GPU kernels (interpreted off GPU), ``backend="pallas"`` takes it for ``"radix"`` on
    GPU: a kernel a pass (``"radix_passes"``) or the whole search in one kernel with a cluster of CTAs a row
    (``"radix_cluster"``), whichever was faster on the H200 for the shape (``select.pick_kernel``)."""
    if selection not in SELECTIONS:
        raise ValueError(f"select_blocks: selection must be one of {SELECTIONS}, got {selection!r}")
    if backend not in BACKENDS:
        raise ValueError(f"select_blocks: backend must be one of {BACKENDS}, got {backend!r}")
    if selection == "auto":
        selection = "radix" if bmax.shape[-1] >= RADIX_MIN_BLOCKS else "top_k"
    if selection == "radix" and backend == "pallas" and jax.default_backend() == "gpu":
        selection = "radix_kernel"
    if selection in _RADIX_KERNEL:
        return select.select_top_blocks(bmax, n_blocks, kernel=_RADIX_KERNEL[selection])
    nb = bmax.shape[-1]
    vals, idx = jax.lax.top_k(bmax, min(n_blocks, nb))  # ties: lower block index, as the reference
    ids = jnp.sort(jnp.where(vals > -jnp.inf, idx, nb), axis=-1)  # dropped blocks sort last
    return jnp.where(ids < nb, ids, -1).astype(jnp.int32)
