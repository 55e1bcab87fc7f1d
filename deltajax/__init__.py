"""deltajax: gated delta rule linear attention (Gated DeltaNet, KDA) for JAX."""

from deltajax.api import IMPLEMENTATIONS
from deltajax.api import gated_delta
from deltajax.api import gated_delta_step
from deltajax.api import gdn2
from deltajax.api import kda
from deltajax.api import value_checks
from deltajax import parallel
from deltajax import registry

__version__ = "0.1.0"

__all__ = ["IMPLEMENTATIONS", "gated_delta", "gated_delta_step", "gdn2", "kda",
           "parallel", "registry", "value_checks", "__version__"]
