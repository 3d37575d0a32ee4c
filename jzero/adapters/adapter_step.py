"""The step both Flax adapters return: the core step on ``state.zero``, re-wrapped."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.step_options import StepOptions
from ..core.train_step import Metrics, TrainStep
from ..core.zero_state import ZeroState


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
