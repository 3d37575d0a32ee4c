"""Placement: model states between their true-shaped (user) view and their stored form.

Everything here follows the :class:`Plan`: ``store`` pads the leaves it stores partitioned,
``view`` slices the padding off again;
``init_program`` builds a fresh state straight into that layout and ``full_params`` brings
the parameters (``full_state``: every model state) back whole. ``to_device`` and ``to_host``
move leaves between memory kinds inside a jitted program (optimizer offload). Programs
compute on the plan's compute mesh and constrain to it; what they return is typed with the
user's mesh (:meth:`Plan.state_shardings`, :func:`typed_state`; :mod:`.axis_types`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from .axis_types import is_auto, on_compute_mesh, typed
from .host_memory import in_host_memory
from .input_checks import check_live
from .leaf_layout import pad, unpad
from .options.precision import LossScale, Precision
from .plan import Pending, Plan, Stored, ZeroState


def _map(fn: Callable[[jax.Array, Stored], jax.Array], tree: Any, stored: tuple[Stored, ...]):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([fn(x, s) for x, s in zip(leaves, stored)])


def store(tree: Any, stored: tuple[Stored, ...]) -> Any:
    """True shapes -> stored shapes: the leaves stored partitioned are zero-padded."""
    return _map(lambda x, s: pad(x, s.layout) if s.partitioned else x, tree, stored)


def view(tree: Any, stored: tuple[Stored, ...]) -> Any:
    """Stored shapes -> true shapes: the padding is sliced off."""
    return _map(lambda x, s: unpad(x, s.layout) if s.partitioned else x, tree, stored)


def device_sharding(plan: Plan, stored: Stored) -> jax.sharding.NamedSharding:
    """The leaf's planned sharding, but in the device's own memory (where XLA computes)."""
    return plan.compute_sharding(stored).with_memory_kind("device")


def to_device(plan: Plan, tree: Any, stored: tuple[Stored, ...]) -> Any:
    """Stored leaves -> the same shards in device memory (a copy only for offloaded leaves)."""
    move = lambda x, s: x if s.memory_kind is None else jax.device_put(x, device_sharding(plan, s))
    return _map(move, tree, stored)


def to_host(plan: Plan, tree: Any, stored: tuple[Stored, ...]) -> Any:
    """Leaves in device memory -> their planned sharding and memory kind (e.g. pinned host
    memory). The sharding is constrained first: XLA:CPU compiles the move itself away. A
    leaf already in host memory (a gradient copied there in backward) is only placed."""
    return _map(functools.partial(_to_host, plan), tree, stored)


def _to_host(plan: Plan, x: jax.Array, s: Stored) -> jax.Array:
    if s.memory_kind is None:
        return x
    if in_host_memory(x):
        return jax.device_put(x, plan.compute_sharding(s))
    x = jax.lax.with_sharding_constraint(x, device_sharding(plan, s))
    return jax.device_put(x, plan.compute_sharding(s))


def constrain(plan: Plan, tree: Any, stored: tuple[Stored, ...]) -> Any:
    """``with_sharding_constraint`` of every leaf (computed in device memory) to its planned
    sharding on the compute mesh; a leaf the plan stores in host memory is moved there
    (:func:`to_host`)."""

    def place(x: jax.Array, s: Stored) -> jax.Array:
        if s.memory_kind is not None:
            return to_host(plan, [x], [s])[0]
        return jax.lax.with_sharding_constraint(x, plan.compute_sharding(s))

    return _map(place, tree, stored)


def no_pending(plan: Plan) -> Pending | None:
    """A delayed step's held gradient before any exists: zeros, not to be applied
    (``Offload(delay=1)``; None without it). Inside a jitted program."""
    if plan.pending is None:
        return None
    zeros = [jnp.zeros(s.shape, s.dtype) for s in plan.pending]
    grads = to_host(plan, jax.tree.unflatten(plan.params_def, zeros), plan.pending)
    return Pending(grads, jnp.ones((), jnp.float32), jnp.zeros((), jnp.bool_))


def typed_state(state: ZeroState) -> ZeroState:
    """Inside ``jit``: ``state`` with every leaf typed with its sharding on the plan's mesh
    (:func:`.axis_types.typed`), the same as it has on the compute mesh; the model state,
    step and loss scale replicated. On a mesh of ``Auto`` axes, ``state`` as it is."""
    plan = state.plan
    if is_auto(plan.mesh):
        return state
    replicated = lambda tree: typed(tree, jax.tree.map(lambda _: plan.sharding(P()), tree))
    master = None
    if state.master is not None:
        master = typed(state.master, plan.shardings(plan.master, plan.params_def))
    return state.replace(
        step=replicated(state.step),
        params=typed(state.params, plan.shardings(plan.params, plan.params_def)),
        opt_state=typed(state.opt_state, plan.shardings(plan.opt, plan.opt_def)),
        model_state=replicated(state.model_state),
        master=master,
        loss_scale=replicated(state.loss_scale),
        pending=_typed_pending(plan, state.pending),
    )


def _typed_pending(plan: Plan, pending: Pending | None) -> Pending | None:
    if pending is None:
        return None
    replicated = plan.sharding(P())
    return Pending(
        typed(pending.grads, plan.shardings(plan.pending, plan.params_def)),
        *typed((pending.denominator, pending.apply), (replicated, replicated)),
    )


def init_program(
    tx: optax.GradientTransformation,
    plan: Plan,
    precision: Precision,
    make: Callable[[Any], Any],
) -> Callable[[Any], ZeroState]:
    """The jitted ``init(arg) -> ZeroState``: ``make(arg)`` gives true-shaped parameters,
    which are cast, given a fresh Optax state and stored as ``plan`` says."""

    def init(arg: Any) -> ZeroState:
        p = precision.cast(make(arg), jnp.float32)  # the master weights Optax updates
        return ZeroState(
            step=jnp.zeros((), jnp.int32),
            params=store(precision.cast(p), plan.params),
            opt_state=store(tx.init(p), plan.opt),
            model_state=None,
            master=None if plan.master is None else store(p, plan.master),
            loss_scale=LossScale.create(precision) if precision.dynamic_loss_scale else None,
            plan=plan,
            pending=no_pending(plan),
        )

    return jax.jit(on_compute_mesh(init, plan.mesh), out_shardings=plan.state_shardings(precision))


def _whole(plan: Plan, stored: tuple[Stored, ...], treedef: Any) -> Any:
    return jax.tree.unflatten(treedef, [plan.sharding(s.layout.user_spec) for s in stored])


@functools.lru_cache(maxsize=32)
def _full_params_program(plan: Plan) -> Callable[[Any], Any]:
    out = _whole(plan, plan.params, plan.params_def)
    program = lambda params: view(to_device(plan, params, plan.params), plan.params)
    return jax.jit(on_compute_mesh(program, plan.mesh), out_shardings=out)


def full_params(state: ZeroState) -> Any:
    """The whole model, true shapes, replicated over ``data`` (one compiled program per plan).

    A state consumed by a donating step is refused (:func:`.input_checks.check_live`): the
    compiled program would read its deleted buffers, which can crash the process."""
    check_live(state)
    return _full_params_program(state.plan)(state.params)


@functools.lru_cache(maxsize=32)
def _full_state_program(plan: Plan) -> Callable[[Any, Any, Any], Any]:
    master = None if plan.master is None else _whole(plan, plan.master, plan.params_def)
    out = (_whole(plan, plan.params, plan.params_def), _whole(plan, plan.opt, plan.opt_def), master)

    def program(params, opt_state, master):
        if plan.master is not None:
            master = view(to_device(plan, master, plan.master), plan.master)
        opt_state = view(to_device(plan, opt_state, plan.opt), plan.opt)
        return view(to_device(plan, params, plan.params), plan.params), opt_state, master

    return jax.jit(on_compute_mesh(program, plan.mesh), out_shardings=out)


def full_state(state: ZeroState) -> ZeroState:
    """``state`` with parameters, Optax state and master weights whole: true shapes,
    replicated over ``data`` (for inspection and export; it needs a whole copy per device).
    A consumed state is refused, as by :func:`full_params`."""
    check_live(state)
    params, opt_state, master = _full_state_program(state.plan)(
        state.params, state.opt_state, state.master
    )
    return state.replace(params=params, opt_state=opt_state, master=master)
