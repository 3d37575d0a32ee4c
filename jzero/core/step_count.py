"""Which steps a state has taken, known on the host without waiting for the device.

With ``Offload(delay=1)`` the train step runs an exact program for the first
``exact_steps`` steps and a delayed one after (:mod:`.train_step`). Choosing between them
by reading ``state.step`` would wait for the previous step to finish before the next could
be dispatched, so :class:`StepCount` reads it only for a state it has not seen (a fresh
``init``, a restored checkpoint), from this process's own copy, and counts from there.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class StepCount:
    """``of(state)``: how many steps ``state`` has taken; ``taken(new_state)`` after each."""

    def __init__(self) -> None:
        self._last: tuple[Any, int] | None = None  # (the step array we returned, its count)

    def of(self, state: Any) -> int:
        """0 for a state of shapes only (``jax.ShapeDtypeStruct`` s: a lowering)."""
        if self._last is not None and state.step is self._last[0]:
            return self._last[1]
        if not isinstance(state.step, jax.Array):
            return 0
        count = int(np.asarray(state.step.addressable_data(0)))  # waits, once per new state
        self._last = (state.step, count)
        return count

    def taken(self, new_state: Any) -> None:
        if self._last is not None:  # else nothing asked: no count to carry
            self._last = (new_state.step, self._last[1] + 1)
