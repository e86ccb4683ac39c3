"""Block-max candidate selection over the indexer scores (spec attention §6); see ``api``.

Where each kernel runs with ``backend="pallas"``: on GPU the block maxima are ``mosaic`` (Mosaic GPU),
and where the radix select is taken its threshold search is ``radix_mosaic`` or ``radix_cluster``
(Mosaic GPU, ``select.pick_kernel`` chooses); on TPU and interpreted on CPU the block maxima are ``tpu``
(Mosaic TPU) and the selection stays in XLA (``lax.top_k`` or ``select``'s radix passes). ``reference``
is the XLA path (``backend="xla"``).
"""

from pallas_kernels.block_max.api import (
                                          BACKENDS,
                                          RADIX_MIN_BLOCKS,
                                          SELECTIONS,
                                          block_max,
                                          candidate_block_ids,
                                          select_blocks,
)

__all__ = ["BACKENDS", "RADIX_MIN_BLOCKS", "SELECTIONS", "block_max", "candidate_block_ids", "select_blocks"]
