"""What one optimizer update reads, whichever strategy runs it (:mod:`.updaters`: on the
device, streamed through it, or on the host), and what it keeps where the step is skipped."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .grad_reduction import Gradients
from .options.precision import Precision
from .plan import Plan


class UpdateInputs(NamedTuple):
    """One step's update, in the global view.

    ``weights`` are the stored fp32 master weights, or the stored parameters without them
    (device or host memory, as the plan places them); ``finite`` (or None) says whether to
    apply the update or keep the old values (non-finite gradients under dynamic loss
    scaling, an invalid :class:`jzero.Weighted` count). Every strategy returns ``(params,
    opt_state, master)``: the new parameters (true shapes, parameter dtype, on the device),
    the stored new Optax state and the stored master weights (None without them).
    """

    tx: optax.GradientTransformation
    precision: Precision
    plan: Plan
    grads: Gradients
    opt_state: Any
    weights: Any
    finite: jax.Array | None


def keep_if_finite(finite: jax.Array | None, new: Any, old: Any) -> Any:
    """``new`` where the step is applied, ``old`` where ``finite`` is False (leaf by leaf);
    ``new`` when there is no flag."""
    if finite is None:
        return new
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
