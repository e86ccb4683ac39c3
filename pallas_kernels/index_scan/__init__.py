"""index_scan: a KV source's index scores over its whole packed MXFP4 index-key cache (spec attention §3.5);
see ``api``.

``reference`` is the XLA path (unpack every key, one matmul, ReLU, the head-weighted sum); ``triton`` is the
GPU kernel that reads the packed keys once and writes only the scores.
"""

from pallas_kernels.index_scan.api import BACKENDS, MAX_QUERIES, index_scores

__all__ = ["BACKENDS", "MAX_QUERIES", "index_scores"]
