"""The training state: a pytree carrying its own (static) sharding plan."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from .plan import Plan


@struct.dataclass
class ZeroState:
    """Parameters and optimizer state of a ZeRO-partitioned model.

    Attributes:
        step: int32 scalar, replicated; number of train steps taken (steps skipped by
            dynamic loss scaling included; Optax's own counters skip them).
        params: the parameters as stored at rest. Stages 0-2: full, true shapes, replicated
            over 'data'. Stage 3: each sharded leaf padded along its shard dimension and
            partitioned over 'data' (see ``plan``); small leaves replicated.
        opt_state: the Optax state. Stage 0: replicated. Stages 1-3: every leaf laid out
            like a parameter of its shape (sharded and padded over 'data').
        master: fp32 master weights when the precision policy stores parameters in a
            16-bit dtype, laid out like the optimizer state (sharded over 'data' in stages
            1-3, padded); None otherwise.
        loss_scale: dynamic loss-scaling state (:class:`LossScale`), or None.
        model_state: non-trainable model state (e.g. Flax ``batch_stats``), replicated over
            'data' and kept identical on every device; None when the model has none.
        plan: the static :class:`Plan`: where every leaf lives (not a pytree node).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    master: Any
    loss_scale: Any
    plan: Plan = struct.field(pytree_node=False)
