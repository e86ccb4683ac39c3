"""FP4 packing, unpacking and fused cache writes of the main-KV (NVFP4) and index-key (MXFP4) cache
formats; see ``api``."""

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
