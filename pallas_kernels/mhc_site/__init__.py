"""One mHC site at decode in one kernel: expand, the coefficients' matvec and norm, and collapse."""

from pallas_kernels.mhc_site.kernel import fused_site, reference_site

__all__ = ["fused_site", "reference_site"]
