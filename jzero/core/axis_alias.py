"""Batch-axis aliases: a model's own name for the batch axis, mapped onto jzero's.

Models name the axis their collectives reduce over, e.g. Flax ``nn.BatchNorm(axis_name=
'batch')`` for synchronised statistics; jzero splits the batch over ``'data'`` (over
``('replica', 'data')`` on a hybrid mesh). JAX has no axis aliasing, so a step built with
``axis_name='batch'``:

1. runs its ``shard_map`` on the mesh with one more axis of size 1 per alias
   (:func:`alias_mesh`), so that code naming ``'batch'`` can be traced at all;
2. calls the loss through :func:`aliased`: it traces the loss to a jaxpr with the alias
   bound at the batch size, then evaluates that jaxpr, binding every collective over the
   alias over the batch axes instead (``psum``, ``pmean``, ``all_gather``, ``axis_index``,
   ...; inside ``jit``, ``scan``, ``cond``, ``while_loop`` and ``checkpoint`` too).

Without an alias none of this runs. :mod:`.axis_names` checks the names and explains
JAX's error for a collective over an axis the step lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src.core import pvary_p  # not exported: the no-op cast JAX inserts before psum
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.extend.core import primitives as prims
from jax.sharding import AxisType, Mesh

_AXIS_PARAMS = ("axes", "axis_name")  # the params that name mesh axes in collectives


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
    rename = {a: tuple(axes) for a in aliases}

    def call(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(
            fn, axis_env=[(a, size) for a in aliases], return_shape=True
        )(*args)
        out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), rename)
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


def _varying(x: Any) -> frozenset[str]:
    return jax.typeof(x).mat.varying


def _lift(x: Any, aval: Any, rename: dict[str, tuple[str, ...]]) -> Any:
    """``x`` made varying over every axis the traced jaxpr had it vary over (renamed).

    A reduction over the alias leaves its result invariant over the batch axes, where the
    trace (over a separate alias axis) had it still varying over them; the ops that follow
    were typed for that, so the value is cast back (a no-op on the data).
    """
    want = getattr(getattr(aval, "mat", None), "varying", frozenset())
    want = {m for n in want for m in rename.get(n, (n,))}
    missing = tuple(sorted(want - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _mentions(jaxpr: Jaxpr, aliases: Any) -> bool:
    """Whether ``jaxpr`` (or one inside it) names an alias, in a param or a value's type."""
    for eqn in jaxpr.eqns:
        for v in (*eqn.invars, *eqn.outvars):
            if set(getattr(getattr(v.aval, "mat", None), "varying", ())) & set(aliases):
                return True
        for k in _AXIS_PARAMS:
            names = eqn.params.get(k)
            names = (names,) if isinstance(names, str) else names
            if isinstance(names, tuple | list) and set(names) & set(aliases):
                return True
        if any(_mentions(sub, aliases) for sub in _subjaxprs(eqn.params)):
            return True
    return False


def _subjaxprs(params: dict[str, Any]) -> Iterator[Jaxpr]:
    for v in params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if isinstance(j, ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, Jaxpr):
                yield j


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], rename: dict) -> list[Any]:
    env: dict[Any, Any] = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_lift(read(v), v.aval, rename) for v in eqn.invars]
        with eqn.ctx.manager:
            out = _apply(eqn, invals, rename)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return [_lift(read(v), v.aval, rename) for v in jaxpr.outvars]


def _apply(eqn: Any, invals: list[Any], rename: dict) -> Any:
    prim, params = eqn.primitive, eqn.params
    if prim is pvary_p:
        axes = _renamed(params["axes"], rename)
        missing = tuple(a for a in axes if a not in _varying(invals[0]))
        return jax.lax.pcast(invals[0], missing, to="varying") if missing else invals[0]
    if any(_mentions(sub, rename) for sub in _subjaxprs(params)):
        rule = _HIGHER_ORDER.get(prim)
        if rule is None:
            raise NotImplementedError(
                f"loss_fn uses a collective over the aliased axis {sorted(rename)} inside "
                f"{prim.name!r}, which jzero cannot alias (custom_jvp / custom_vjp rules are "
                "opaque to it); name the batch axis 'data' in that function."
            )
        return rule(params, invals, rename)
    params = {k: _renamed(v, rename) if k in _AXIS_PARAMS else v for k, v in params.items()}
    if prim is prims.axis_index_p:  # one axis per bind: the public function combines several
        return jax.lax.axis_index(params["axis_name"])
    return prim.bind(*invals, **prim.get_bind_params(params))


def _closed(closed: ClosedJaxpr, rename: dict) -> Callable[..., list[Any]]:
    return lambda *args: _eval(closed.jaxpr, closed.consts, args, rename)


def _inline(params: dict, invals: list[Any], rename: dict) -> list[Any]:
    return _closed(params["jaxpr"], rename)(*invals)


def _checkpoint(params: dict, invals: list[Any], rename: dict) -> list[Any]:
    body = lambda *a: _eval(params["jaxpr"], (), a, rename)
    fn = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    return fn(*invals)


def _scan(params: dict, invals: list[Any], rename: dict) -> list[Any]:
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, rest = invals[:n_consts], invals[n_consts:]
    init, xs = rest[:n_carry], rest[n_carry:]
    body = _closed(params["jaxpr"], rename)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = body(*consts, *carry, *x)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(
        step, init, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]


def _cond(params: dict, invals: list[Any], rename: dict) -> list[Any]:
    branches = [_closed(b, rename) for b in params["branches"]]
    return jax.lax.switch(invals[0], branches, *invals[1:])


def _while(params: dict, invals: list[Any], rename: dict) -> list[Any]:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    cond, body = _closed(params["cond_jaxpr"], rename), _closed(params["body_jaxpr"], rename)
    return jax.lax.while_loop(
        lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), init
    )


_HIGHER_ORDER = {
    prims.jit_p: _inline,
    prims.closed_call_p: _inline,
    prims.remat_p: _checkpoint,
    prims.scan_p: _scan,
    prims.cond_p: _cond,
    prims.while_p: _while,
}
