"""``jzero.linen``: train Flax Linen modules with ZeRO (see :mod:`jzero.adapters.linen`)."""

from .adapters.linen import TrainState as TrainState
