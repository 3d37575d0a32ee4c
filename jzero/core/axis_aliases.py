"""Batch-axis aliases: a model's own name for the batch axis, mapped onto jzero's.

Models name the axis their collectives reduce over, e.g. Flax ``nn.BatchNorm(axis_name=
'batch')`` for synchronised statistics; jzero splits the batch over ``'data'`` (over
``('replica', 'data')`` on a hybrid mesh). JAX has no axis aliasing, so a step built with
``axis_name='batch'``:

1. runs its ``shard_map`` on the mesh with one more axis of size 1 per alias
   (:func:`alias_mesh`), so that code naming ``'batch'`` can be traced at all;
2. calls the loss through :func:`aliased`: it traces the loss to a jaxpr with the alias
   bound at the batch size, then evaluates that jaxpr with jzero's jaxpr interpreter
   (:mod:`jzero.internal.interpret`), binding every collective over the alias over the
   batch axes instead (``psum``, ``pmean``, ``all_gather``, ``axis_index``, ...; inside
   ``jit``, ``scan``, ``cond``, ``while_loop`` and ``checkpoint`` too).

Without an alias none of this runs.

Unknown axes: inside ``shard_map``, ``lax.psum(x, 'batch')`` on a mesh without ``'batch'``
fails in JAX's ``pvary`` with a bare ``AssertionError``, and ``all_gather`` /
``axis_index`` with ``NameError: unbound axis name``. When the loss fails to trace,
:func:`explain_unknown_axis` traces it again on its own
(:func:`jzero.internal.unbound_axes.unbound_axes`) and, if one of its collectives names an
axis that is neither a mesh axis nor an alias, raises an error that names the axis, the
collective, the line that calls it and the fix (``axis_name=``). Any other failure is left
as it was. An axis the loss binds itself with ``jax.vmap(..., axis_name=...)`` is never
named here (the vmap binds it in that trace too): the step runs such a loss through
:mod:`jzero.internal.vmap_axes` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from ..internal.equation import Equation, mentions, trace
from ..internal.interpret import REBINDS, Interpreter, bind, rebind, run
from ..internal.primitives import Kind, traced_varying_axes, varying_axes
from ..internal.unbound_axes import unbound_axes


def alias_mesh(mesh: Mesh, aliases: Sequence[str]) -> Mesh:
    """``mesh`` with one more axis of size 1 per alias, over the same devices."""
    return Mesh(
        mesh.devices.reshape(mesh.devices.shape + (1,) * len(aliases)),
        tuple(mesh.axis_names) + tuple(aliases),
        axis_types=tuple(mesh.axis_types) + (AxisType.Auto,) * len(aliases),
    )


def aliased(fn: Callable, *, aliases: Sequence[str], axes: tuple[str, ...], size: int) -> Callable:
    """``fn`` with its collectives over any of ``aliases`` run over ``axes`` instead.

    Call it inside a ``shard_map`` over :func:`alias_mesh` whose ``axes`` have ``size``
    devices in all. It is differentiable (the jaxpr's primitives are bound again), and a
    custom derivative rule (``custom_jvp`` / ``custom_vjp``) that names an alias raises.
    """
    rules = _Aliasing({a: tuple(axes) for a in aliases})

    def call(*args: Any) -> Any:
        env = [(a, size) for a in aliases]
        closed, shape = trace(fn, *args, axis_env=env, return_shape=True)
        out = run(closed, jax.tree.leaves(args), rules)
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return call


def _renamed(names: Any, rename: dict[str, tuple[str, ...]]) -> Any:
    """An ``axes`` / ``axis_name`` param with every alias replaced by the axes it stands for."""
    if isinstance(names, str):
        target = rename.get(names, (names,))
        return target[0] if len(target) == 1 else target
    if not isinstance(names, tuple | list):
        return names
    out: list[Any] = []
    for n in names:
        for m in rename.get(n, (n,)) if isinstance(n, str) else (n,):
            if m not in out:
                out.append(m)
    return tuple(out)


class _Aliasing(Interpreter):
    """The rules of batch-axis aliases for jzero's interpreter: every collective over an
    alias runs over the axes it stands for, inside higher-order primitives too."""

    def __init__(self, rename: dict[str, tuple[str, ...]]):
        self.rename = rename

    def read(self, x: Any, atom: Any) -> Any:
        """``x`` made varying over every axis the traced jaxpr had it vary over (renamed).

        A reduction over the alias leaves its result invariant over the batch axes, where
        the trace (over a separate alias axis) had it still varying over them; the ops that
        follow were typed for that, so the value is cast back (a no-op on the data).
        """
        want = {m for n in traced_varying_axes(atom) for m in self.rename.get(n, (n,))}
        missing = tuple(sorted(want - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any]:
        args = [self.read(x, v) for x, v in zip(values, eqn.inputs)]
        rename = lambda names: _renamed(names, self.rename)
        if eqn.kind is Kind.PVARY:
            missing = tuple(a for a in rename(eqn.axes) if a not in varying_axes(args[0]))
            return [jax.lax.pcast(args[0], missing, to="varying") if missing else args[0]]
        if any(mentions(sub, self.rename) for sub in eqn.subjaxprs):
            if eqn.kind not in REBINDS:
                raise NotImplementedError(
                    f"loss_fn uses a collective over the aliased axis {sorted(self.rename)} "
                    f"inside {eqn.api_name!r}, which jzero cannot alias (custom_jvp / "
                    "custom_vjp rules are opaque to it); name the batch axis 'data' in that "
                    "function."
                )
            return rebind(eqn, args, self)
        if eqn.kind is Kind.AXIS_INDEX:  # one axis per bind: the public function combines
            return [jax.lax.axis_index(rename(eqn.axes))]
        return bind(eqn, args, eqn.renamed(rename))


def explain_unknown_axis(
    error: BaseException, fn: Callable[..., Any], args: Sequence[Any], axis_sizes: Mapping[str, int]
) -> None:
    """Raises a ValueError (from ``error``, the failure of ``fn(*args)``) if a collective in
    ``fn`` names an axis not in ``axis_sizes`` (the step's mesh axes and aliases, with their
    sizes); returns otherwise."""
    found = unbound_axes(fn, args, axis_sizes)
    if not found:
        return
    name, api, where = found[0]
    at = f" (at {where})" if where else ""
    raise ValueError(
        f"loss_fn calls jax.lax.{api} over axis {name!r}{at}, which the step does "
        f"not have (mesh axes and aliases: {tuple(axis_sizes)}). If {name!r} is the model's "
        f"name for the batch axis (e.g. nn.BatchNorm(axis_name={name!r})), build the step "
        f"with train_step(..., axis_name={name!r}): jzero then runs its collectives over the "
        "batch axes. Otherwise add the axis to the mesh."
    ) from error


def as_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_aliases(axis_name: Any, mesh_axes: Sequence[str]) -> tuple[str, ...]:
    """``axis_name=`` (None, a name or a tuple of names) -> a tuple of new axis names."""
    if not (axis_name is None or isinstance(axis_name, str | tuple)):
        raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}.")
    names = () if axis_name is None else as_tuple(axis_name)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}.")
        if n in mesh_axes:
            raise ValueError(
                f"axis_name={n!r} is already an axis of the mesh {tuple(mesh_axes)}; pass only "
                "the model's own names for the batch axis (the mesh's axes need no alias)."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name {names} names an axis twice.")
    return names
