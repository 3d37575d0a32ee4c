"""``jzero.nnx``: train Flax NNX modules with ZeRO (see :mod:`jzero.adapters.nnx`)."""

from .adapters.nnx import TrainState as TrainState
from .adapters.nnx import gathered as gathered
from .adapters.nnx import remat_layer as remat_layer
from .adapters.nnx import remat_module as remat_module
from .adapters.nnx_optimizer import ModelAndOptimizer as ModelAndOptimizer
from .adapters.nnx_optimizer import Optimizer as Optimizer
