"""Sparse MQA attention at V4.1's shape (spec attention §3.6); see ``api``.

``reference`` is the kernels' form in XLA (a key row list per query), ``layout`` builds that form from the
model's arguments, ``mosaic`` is the Hopper forward for 64-head groups (Mosaic GPU), ``triton_mqa`` the forward
and backward below 64 heads (Triton), ``tpu`` the TPU forward and backward (Mosaic TPU), ``packed_decode`` a
decode step straight from the packed caches (Triton); all interpreted on CPU for tests.
"""

from pallas_kernels.sparse_attention.api import BACKENDS, kernel_applies, sparse_attention, sparse_mqa

__all__ = ["BACKENDS", "kernel_applies", "sparse_attention", "sparse_mqa"]
