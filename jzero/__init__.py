"""jzero: ZeRO (Zero Redundancy Optimizer, stages 0-3) for JAX and Optax."""

from ._collectives import Sharded as Sharded
from ._collectives import gather as gather
from ._estimate import Estimate as Estimate
from ._estimate import estimate as estimate
from ._estimate import max_params as max_params
from ._layout import LeafLayout as LeafLayout
from ._layout import Plan as Plan
from ._mesh import data_mesh as data_mesh
from ._optimizer import ZeroOptimizer as ZeroOptimizer
from ._precision import Precision as Precision
from ._remat import remat_layer as remat_layer
from ._report import Report as Report
from ._report import report as report
from ._state import ZeroState as ZeroState

__version__ = "0.1.0"
