"""Pallas kernels, one folder per op (tokamax layout): ``reference`` (the XLA path the model uses), ``tpu``
(Mosaic TPU; interpret mode on CPU), the GPU kernels (``mosaic`` for Mosaic GPU, Triton where a kernel suits it
better: fewer than 64 heads, fp32 atomics, byte-packed rows decoded per lane; and the op's other GPU modules;
interpret mode on CPU), ``api`` (picks by ``backend`` and platform) and ``bench`` (JSON lines against the
copy-bandwidth floor of notes/PLATFORM.md). ``mosaic_stream`` holds what the Mosaic GPU kernels of every op
share.
"""
