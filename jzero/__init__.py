"""jzero: ZeRO (Zero Redundancy Optimizer, stages 0-3) for JAX and Optax.

Layout of the package: ``jzero.core`` (mesh, plan and leaf layouts, collectives, stored
form, train step, precision, communication, remat), ``jzero.adapters`` (the Flax adapters,
published as ``jzero.linen`` and ``jzero.nnx``), ``jzero.accounting`` (estimates, HLO
collectives, report), ``jzero.checkpoint`` (Orbax checkpoints, safetensors export) and
``jzero.cli``.
"""

from jzero import autoconfig as autoconfig
from jzero import checkpoint as checkpoint
from jzero import distributed as distributed
from jzero import linen as linen
from jzero import nnx as nnx

from .accounting.estimate import Estimate as Estimate
from .accounting.estimate import estimate as estimate
from .accounting.estimate import max_params as max_params
from .accounting.report import Report as Report
from .accounting.report import report as report
from .autoconfig import autoconfigure as autoconfigure
from .checkpoint import Checkpointer as Checkpointer
from .config.deepspeed import from_deepspeed_config as from_deepspeed_config
from .core.comm.gatherer import Sharded as Sharded
from .core.comm.gatherer import gather as gather
from .core.gather.remat import remat_layer as remat_layer
from .core.gpu_target import gpu_mesh as gpu_mesh
from .core.leaf_layout import LeafLayout as LeafLayout
from .core.mesh import data_mesh as data_mesh
from .core.mesh import hybrid_mesh as hybrid_mesh
from .core.options.communication import Communication as Communication
from .core.options.layout import Layout as Layout
from .core.options.offload import Offload as Offload
from .core.options.precision import Precision as Precision
from .core.options.step import StepOptions as StepOptions
from .core.options.zero_config import ZeroConfig as ZeroConfig
from .core.plan import Plan as Plan
from .core.plan import ZeroState as ZeroState
from .core.weighted import Weighted as Weighted
from .optimizers.user_step.placement import shard_params as shard_params
from .optimizers.user_step.transformation import MasterWeightsState as MasterWeightsState
from .optimizers.user_step.transformation import shard_optimizer as shard_optimizer
from .optimizers.zero_optimizer import ZeroOptimizer as ZeroOptimizer

__version__ = "0.1.0"
