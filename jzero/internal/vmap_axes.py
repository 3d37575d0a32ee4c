"""A loss that reduces over an axis it binds itself with ``jax.vmap(..., axis_name=...)``,
run inside ``jax.shard_map`` as plain ``jax.jit`` runs it.

Inside ``shard_map`` with its varying-axes checks (``check_vma=True``, which jzero's step
needs: DESIGN.md section 4), JAX cannot trace ``lax.psum(x, 'batch')`` over a vmap's own
axis: ``pvary`` asserts that 'batch' is a mesh axis (a bare ``AssertionError``), and with a
mesh axis of that name the vmap rewrites the psum into one over array positions, which the
checked psum refuses. Without the checks the same vmap gives a ``psum`` over positions,
i.e. a plain sum over the vmapped dimension, as under ``jax.jit``.

:func:`without_vma_checks` traces the loss that way, then evaluates the jaxpr with the
checks on (:mod:`.interpret`): a reduction over positions becomes the same reduction in
``jax.numpy``; a collective over mesh axes is called again through ``jax.lax`` (which
casts its operand to varying as under the checks); every other equation is bound with its
operands cast to the union of their varying axes, as JAX's own type rules do. A
``custom_jvp`` function is applied again with its rule evaluated the same way; a
``custom_vjp`` function is refused, naming its line (its rule's output types are fixed
by the unchecked trace).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

try:
    from jax._src import config as _config  # the varying-axes check flag of shard_map
except ImportError:
    _config = None

from .equation import Equation
from .interpret import REBINDS, Interpreter, bind, rebind, run
from .moved import InternalMoved, param
from .primitives import Kind, varying_axes

_REDUCTIONS = {  # api name -> (the reduction over positions, the collective over names)
    "psum/pmean": (jnp.sum, jax.lax.psum),
    "pmax": (jnp.max, jax.lax.pmax),
    "pmin": (jnp.min, jax.lax.pmin),
}


def without_vma_checks(fn: Callable) -> Callable:
    """``fn`` traced without the varying-axes checks, evaluated with them (call it inside
    ``jax.shard_map``). Differentiable: every primitive is bound again."""

    def call(*args: Any) -> Any:
        with _unchecked():
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = run(closed, jax.tree.leaves(args), _Checked())
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return call


def _unchecked() -> Any:
    """JAX's context that turns shard_map's varying-axes checks off."""
    check_vma = getattr(_config, "_check_vma", None)
    if check_vma is None:
        raise InternalMoved("jax._src.config._check_vma (shard_map's varying-axes checks)")
    return check_vma(False)


def _reduce(api: str, x: jax.Array, axes: Any) -> jax.Array:
    positions = tuple(a for a in axes if isinstance(a, int))
    names = tuple(a for a in axes if not isinstance(a, int))
    over_positions, over_names = _REDUCTIONS[api]
    if positions:
        x = over_positions(x, axis=positions)
    return over_names(x, names) if names else x


def _unified(args: list[Any]) -> list[Any]:
    """``args`` each cast to varying over every axis any of them varies over."""
    every = frozenset().union(*(varying_axes(x) for x in args))

    def cast(x: Any) -> Any:
        missing = tuple(sorted(every - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return [cast(x) for x in args]


class _Checked(Interpreter):
    """A jaxpr traced without varying-axes checks, evaluated with them."""

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any]:
        if eqn.api_name in _REDUCTIONS:
            return [_reduce(eqn.api_name, x, eqn.axes) for x in values]
        if eqn.kind is Kind.PVARY:
            missing = tuple(a for a in eqn.axis_names if a not in varying_axes(values[0]))
            return [jax.lax.pcast(values[0], missing, to="varying") if missing else values[0]]
        if eqn.subjaxprs and eqn.kind in REBINDS:
            return rebind(eqn, values, self)
        if eqn.kind is Kind.CUSTOM_JVP:
            return _custom_jvp(eqn, _unified(values), self)
        if eqn.kind is Kind.CUSTOM_VJP:
            at = f" (at {eqn.where})" if eqn.where else ""
            raise NotImplementedError(
                "loss_fn reduces over an axis it binds itself with jax.vmap(..., axis_name=...), "
                "which jzero traces without JAX's varying-axes checks and evaluates again with "
                f"them; it also calls a jax.custom_vjp function{at}, whose rule jzero cannot "
                "evaluate that way. Define that function's derivative with jax.custom_jvp "
                "instead (jzero evaluates custom_jvp rules again)."
            )
        args = _unified(values)
        if eqn.axis_names and eqn.kind is not Kind.AXIS_INDEX:  # a collective over names
            names = tuple(sorted(eqn.axis_names))
            args = [_cast(x, names) for x in args]
        return bind(eqn, args)


def _cast(x: Any, names: tuple[str, ...]) -> Any:
    missing = tuple(a for a in names if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _custom_jvp(eqn: Equation, args: list[Any], rules: Interpreter) -> list[Any]:
    """A ``custom_jvp`` function applied again: its body and its derivative rule (as JAX
    traced it, without the checks) each evaluated under ``rules``."""
    params = eqn.params
    body = param(params, "call_jaxpr", "custom_jvp_call")
    rule = param(params, "jvp_jaxpr_fun", "custom_jvp_call")

    @jax.custom_jvp
    def call(*a: Any) -> tuple:
        return tuple(run(body, a, rules))

    @call.defjvp
    def jvp(primals: tuple, tangents: tuple) -> tuple:
        jaxpr, consts, out_zeros = rule.call_wrapped(*[False] * len(tangents))
        out = run(jaxpr, [*primals, *tangents], rules, consts=consts)
        primals_out, nonzero = out[: len(out_zeros)], iter(out[len(out_zeros) :])
        tangents_out = [
            jnp.zeros_like(p) if zero else next(nonzero) for p, zero in zip(primals_out, out_zeros)
        ]
        return tuple(primals_out), tuple(tangents_out)

    return list(call(*args))
