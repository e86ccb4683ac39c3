"""FP4 packing, unpacking and fused cache writes of the main-KV (NVFP4) and index-key (MXFP4) cache
formats; see ``api``.

Where each kernel runs with ``backend="pallas"``: on GPU (Mosaic GPU) pack and the cache write are
``direct`` (the bf16 encode in ``pairs``), unpack is ``mosaic``; on TPU (Mosaic TPU) and interpreted on
CPU all three are ``tpu``. ``reference`` is the XLA path (``backend="xla"``).
"""

from pallas_kernels.fp4_pack.api import (
    BACKENDS,
    pack_mxfp4,
    pack_nvfp4,
    unpack_mxfp4,
    unpack_nvfp4,
    write_mxfp4,
    write_nvfp4,
)

__all__ = ["BACKENDS", "pack_mxfp4", "pack_nvfp4", "unpack_mxfp4", "unpack_nvfp4", "write_mxfp4", "write_nvfp4"]
