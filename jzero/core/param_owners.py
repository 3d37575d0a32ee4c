"""Which parameter each Optax-state leaf belongs to, as Optax itself says.

``optax.tree_map_params`` knows which leaves of a transformation's state are shaped like
the parameters (Adam's moments, a momentum trace) and which are not (counts, scalars,
Adafactor's factored statistics). Matching by shape instead would give two same-shaped
parameters with different specs the same layout for their moments.
"""

from __future__ import annotations

from typing import Any

import jax
import optax


def param_owners(
    tx: optax.GradientTransformation, params_def: Any, opt_state: Any
) -> list[int] | None:
    """Per leaf of ``opt_state``, the index of the parameter leaf it belongs to (-1: none);
    None when Optax cannot tell (an ``init`` that inspects its parameters' values)."""
    index = jax.tree.unflatten(params_def, list(range(params_def.num_leaves)))
    try:
        owners = optax.tree_map_params(
            tx, lambda _, i: i, opt_state, index, transform_non_params=lambda _: -1
        )
    except Exception:  # noqa: BLE001 -- any failure means: ownership unknown
        return None
    owners = jax.tree.leaves(owners)
    return owners if len(owners) == len(jax.tree.leaves(opt_state)) else None
