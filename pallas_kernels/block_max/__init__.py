"""Block-max candidate selection over the indexer scores (spec attention §6); see ``api``."""

from pallas_kernels.block_max.api import (
                                          BACKENDS,
                                          RADIX_MIN_BLOCKS,
                                          SELECTIONS,
                                          block_max,
                                          candidate_block_ids,
                                          select_blocks,
)

__all__ = ["BACKENDS", "RADIX_MIN_BLOCKS", "SELECTIONS", "block_max", "candidate_block_ids", "select_blocks"]
