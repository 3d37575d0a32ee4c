"""What both Flax adapters share: the optimizer they build from a configuration, the
``layers=`` classes they gather per layer, and the step they return (the core step on
``state.zero``, re-wrapped)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from ..core.options.step import StepOptions
from ..core.options.zero_config import ZeroConfig
from ..core.plan import ZeroState
from ..core.train_step import Metrics, TrainStep
from ..optimizers.zero_optimizer import ZeroOptimizer


class AdapterStep:
    """``step(state, batch) -> (state, metrics)`` for an adapter ``TrainState``.

    It calls the jitted core step on ``state.zero`` (so a donated, consumed state is refused
    the same way) and returns ``state`` with the new ``zero``. ``lower(state, batch)`` gives
    the core program's lowering, for the adapter ``state`` or its ``state.zero``, e.g. for
    ``jzero.report(step, state.zero, batch)``.
    """

    def __init__(self, core: TrainStep):
        self.core = core

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Metrics]:
        zero, metrics = self.core(state.zero, batch)
        return state.replace(zero=zero), metrics

    def lower(self, state: Any, batch: Any) -> Any:
        zero = state if isinstance(state, ZeroState) else state.zero
        return self.core.lower(zero, batch)


def adapter_options(options: StepOptions, *, with_model_state: bool) -> StepOptions:
    """The user's options with the adapter's own model-state protocol (the adapter, not
    the user, knows whether the loss carries model state)."""
    if options.with_model_state:
        raise TypeError(
            "with_model_state is the adapter's to set (it passes the model's non-parameter "
            "collections itself); leave it out of the Flax TrainState's train_step options."
        )
    return dataclasses.replace(options, with_model_state=with_model_state)


def adapter_optimizer(tx: Any, mesh: Mesh, config: ZeroConfig, param_specs: Any) -> ZeroOptimizer:
    """The optimizer for ``config`` with the adapter's own ``param_specs`` (read from the
    model's metadata and fitted to ``mesh``; the rules are applied in them already)."""
    layout = dataclasses.replace(config.layout, param_specs=param_specs, rules=None)
    return ZeroOptimizer(tx, mesh, config=dataclasses.replace(config, layout=layout))


def layer_classes(layers: Any, base: type, what: str) -> tuple[type, ...]:
    """``layers`` (a class or a tuple of classes) as a tuple of subclasses of ``base``, or
    a TypeError naming what was given; ``what`` names ``base`` in the message."""
    classes = layers if isinstance(layers, tuple) else (layers,)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, base)):
            raise TypeError(
                f"layers= takes {what} class or a tuple of them (e.g. layers=Block), "
                f"got {c!r} of type {type(c).__name__}."
            )
    return classes
