"""Pallas GPU kernels (lowered through Triton) for the gated delta rule."""

from deltajax.pallas.core import Config
from deltajax.pallas.core import gpu_capability
from deltajax.pallas.core import Launch
from deltajax.pallas.core import MIN_CAPABILITY
from deltajax.pallas.ops import gated_delta_pallas

__all__ = ["Config", "gated_delta_pallas", "gpu_capability", "Launch",
           "MIN_CAPABILITY"]
