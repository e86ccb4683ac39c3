"""Block-max candidate selection over the indexer scores (spec attention §6); see ``api``."""

from pallas_kernels.block_max.api import BACKENDS, block_max, candidate_block_ids

__all__ = ["BACKENDS", "block_max", "candidate_block_ids"]
