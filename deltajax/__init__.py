"""deltajax: gated delta rule linear attention (Gated DeltaNet, KDA) for JAX.

``deltajax.pallas.Config`` and ``deltajax.mosaic.Config`` are the tuning
configs of ``impl="pallas"`` and ``impl="mosaic"`` (``gated_delta(...,
config=...)``).
"""

from deltajax.api import IMPLEMENTATIONS
from deltajax.api import gated_delta
from deltajax.api import gated_delta_commit
from deltajax.api import gated_delta_step
from deltajax.api import gated_delta_verify
from deltajax.api import gdn2
from deltajax.api import kda
from deltajax.api import value_checks
from deltajax import mosaic
from deltajax import pallas
from deltajax import parallel
from deltajax import registry

__version__ = "0.1.0"

__all__ = ["IMPLEMENTATIONS", "gated_delta", "gated_delta_commit",
           "gated_delta_step", "gated_delta_verify", "gdn2", "kda", "mosaic",
           "pallas", "parallel", "registry", "value_checks", "__version__"]
