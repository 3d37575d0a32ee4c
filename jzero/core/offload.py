"""Optimizer offload: optimizer state and fp32 master weights rest in pinned host memory.

ZeRO-Offload's split (Ren et al. 2021), which moves the least: parameters, gradients and
the forward/backward stay on the device; the sharded optimizer state and master weights
live in host memory. Each step streams them through the device bucket by bucket: a
bucket's state is copied in, updated next to its (device) gradients, and copied back; only
the new parameters stay on the device. A bucket is one parameter leaf and its state,
after the update's global part (counters, a global gradient norm) has run, when the
Optax transformation splits that way (:func:`.split.split_update`); otherwise the whole
tree is one bucket (correct for any transformation, but then the device holds the whole
state while it updates).

Bucket k's copies are tied (``optimization_barrier``) to the results of bucket k-2, so the
copy-in of bucket k overlaps the update of bucket k-1 and at most two buckets' state is on
the device. XLA:CPU drops optimization barriers and its memory analysis shows no saving
from host memory: on CPU this module is tested for placement and numerics, not memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import Literal

from .placement import store, to_device, to_host, view
from .plan import HOST, Plan
from .precision import Precision
from .split import evaluate, split_update

OFFLOADS = (None, "optimizer")
_IN_FLIGHT = 2  # buckets whose state may be on the device at once


def check_offload(offload: Any, *, mesh: jax.sharding.Mesh, stage: int) -> bool:
    """Validates ``ZeroOptimizer(offload=...)``; True when the optimizer is offloaded."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be None or 'optimizer', got {offload!r}.")
    if offload is None:
        return False
    if stage == 0:
        raise ValueError(
            "offload='optimizer' needs stage >= 1: at stage 0 every device holds the whole "
            "optimizer state, which ZeRO-Offload does not move; use stage=1, 2 or 3."
        )
    device = mesh.devices.flat[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST not in kinds:
        raise ValueError(
            f"offload='optimizer' needs host memory ({HOST!r}), but the {device.platform} "
            f"backend's devices offer only {kinds}; use offload=None on this backend."
        )
    return True


def offloaded_update(
    tx: optax.GradientTransformation,
    precision: Precision,
    plan: Plan,
    grads: Any,
    opt_state: Any,
    weights: Any,
    finite: jax.Array | None,
) -> tuple[Any, Any, Any]:
    """The Optax update with the state streamed through the device, bucket by bucket.

    Args:
        grads: the averaged fp32 gradients, true shapes, on the device.
        opt_state: the stored Optax state (host memory).
        weights: the stored fp32 master weights (host memory), or the stored fp32
            parameters when there are no master weights (device memory).
        finite: with dynamic loss scaling, whether the gradients are finite (else the old
            state is kept); None otherwise.

    Returns:
        ``(params, opt_state, master)``: the new parameters (true shapes, parameter dtype,
        device memory), the stored new Optax state and master weights (host memory; master
        None without master weights).
    """
    split = split_update(tx, plan)
    jaxpr = split.jaxpr.jaxpr
    w_stored, o_stored = plan.master or plan.params, plan.opt
    g, o, w = jax.tree.leaves(grads), jax.tree.leaves(opt_state), jax.tree.leaves(weights)
    n, m = len(g), len(o)
    here = lambda x, s: view(to_device(plan, [x], [s]), [s])[0]
    there = lambda x, s: to_host(plan, store([x], [s]), [s])[0]
    env = dict(zip(jaxpr.constvars, split.jaxpr.consts)) | dict(zip(jaxpr.invars[:n], g))
    env |= {jaxpr.invars[n + j]: here(o[j], o_stored[j]) for j in split.shared}
    evaluate(split, split.first, env)
    out = lambda k: (
        jaxpr.outvars[k].val if isinstance(jaxpr.outvars[k], Literal) else env[jaxpr.outvars[k]]
    )
    keep = lambda new, old: new if finite is None else jnp.where(finite, new, old)
    new_o, new_w, new_p, done = [None] * m, [None] * n, [None] * n, []
    for k, b in enumerate(split.buckets):
        copy_in = ([o[j] for j in b.opt], [w[i] for i in b.params])
        if k >= _IN_FLIGHT:  # copy in once bucket k-2 is back on the host
            copy_in = jax.lax.optimization_barrier((copy_in, done[k - _IN_FLIGHT]))[0]
        env |= {jaxpr.invars[n + j]: here(x, o_stored[j]) for j, x in zip(b.opt, copy_in[0])}
        env |= {jaxpr.invars[n + m + i]: here(x, w_stored[i]) for i, x in zip(b.params, copy_in[1])}
        evaluate(split, b.eqns, env)
        writes = b.opt + (split.shared if k == 0 else ())
        for j in writes:
            new = keep(out(n + j), env[jaxpr.invars[n + j]])
            new_o[j] = there(new, o_stored[j])
        for i in b.params:
            old = env[jaxpr.invars[n + m + i]]
            new = keep(optax.apply_updates(old, out(i)), old)
            new_p[i], new_w[i] = precision.cast(new), there(new, w_stored[i])
        done.append([new_o[j] for j in writes] + [new_w[i] for i in b.params])
    master = None if plan.master is None else jax.tree.unflatten(plan.params_def, new_w)
    return (
        jax.tree.unflatten(plan.params_def, new_p),
        jax.tree.unflatten(plan.opt_def, new_o),
        master,
    )
