"""Pallas kernels, one folder per op (tokamax layout): ``reference`` (the XLA path the model uses),
``tpu`` (Mosaic TPU; interpret mode on CPU), the GPU kernels (``mosaic`` for Mosaic GPU, Triton where a
kernel needs gathered rows or atomics Mosaic GPU does not give, and the op's other GPU modules; interpret mode
on CPU), ``api`` (picks by ``backend`` and platform) and ``bench`` (JSON lines
against the copy-bandwidth floor of notes/PLATFORM.md). ``mosaic_stream`` holds what the Mosaic GPU
kernels of every op share.
"""
