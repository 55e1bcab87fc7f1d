"""Pallas Mosaic GPU kernels (Hopper) for the gated delta rule."""

from deltajax.mosaic.ops import CHUNK
from deltajax.mosaic.ops import Config
from deltajax.mosaic.ops import gated_delta_mosaic
from deltajax.mosaic.ops import MAX_HEAD_DIM
from deltajax.mosaic.ops import MIN_CAPABILITY

__all__ = ["CHUNK", "Config", "gated_delta_mosaic", "MAX_HEAD_DIM",
           "MIN_CAPABILITY"]
