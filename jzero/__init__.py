"""jzero: ZeRO (Zero Redundancy Optimizer, stages 0-3) for JAX and Optax.

Layout of the package: ``jzero.core`` (mesh, plan and leaf layouts, collectives, stored
form, train step, precision, communication, remat), ``jzero.adapters`` (the Flax adapters,
published as ``jzero.linen`` and ``jzero.nnx``), ``jzero.accounting`` (estimates, HLO
collectives, report), ``jzero.checkpoint`` (Orbax checkpoints, safetensors export) and
``jzero.cli``.
"""

from jzero import checkpoint as checkpoint
from jzero import distributed as distributed
from jzero import linen as linen
from jzero import nnx as nnx

from .accounting.estimate import Estimate as Estimate
from .accounting.estimate import estimate as estimate
from .accounting.estimate import max_params as max_params
from .accounting.report import Report as Report
from .accounting.report import report as report
from .checkpoint import Checkpointer as Checkpointer
from .config.deepspeed import from_deepspeed_config as from_deepspeed_config
from .core.comm.collectives import Sharded as Sharded
from .core.comm.collectives import gather as gather
from .core.communication import Communication as Communication
from .core.gather.remat import remat_layer as remat_layer
from .core.leaf_layout import LeafLayout as LeafLayout
from .core.mesh import data_mesh as data_mesh
from .core.mesh import hybrid_mesh as hybrid_mesh
from .core.offload.options import Offload as Offload
from .core.optimizer import ZeroOptimizer as ZeroOptimizer
from .core.plan import Plan as Plan
from .core.precision import Precision as Precision
from .core.step_options import StepOptions as StepOptions
from .core.weighted import Weighted as Weighted
from .core.zero_state import ZeroState as ZeroState

__version__ = "0.1.0"
