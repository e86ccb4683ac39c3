"""Pallas kernels, one folder per op (tokamax layout): ``reference`` (the XLA path the model uses),
``tpu`` (Mosaic TPU; interpret mode on CPU), ``gpu``, ``api`` (picks by ``backend`` and platform) and
``bench`` (JSON lines against the copy-bandwidth floor of notes/PLATFORM.md).
"""
