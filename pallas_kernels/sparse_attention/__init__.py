"""Sparse MQA attention at V4.1's shape (spec attention §3.6); see ``api``.

``reference`` is the kernels' form in XLA (a key row list per query), ``layout`` builds that form from the
model's arguments, ``mosaic`` is the Hopper kernel (Mosaic GPU; interpreted on CPU for tests).
"""

from pallas_kernels.sparse_attention.api import BACKENDS, kernel_applies, sparse_attention, sparse_mqa

__all__ = ["BACKENDS", "kernel_applies", "sparse_attention", "sparse_mqa"]
