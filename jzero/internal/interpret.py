"""jzero's one jaxpr interpreter: a traced function evaluated again, equation by equation,
with a feature's :class:`Interpreter` deciding what changes.

Four features re-run traced jaxprs: stage 3's deferred gathers
(:mod:`jzero.core.gather.autogather`), batch-axis aliases (:mod:`jzero.core.axis_aliases`),
and the offloaded update's split and chunks (:mod:`jzero.core.offload`). Each is a
:class:`Interpreter` subclass; this module walks the jaxpr, binds every equation a rule leaves
alone exactly as traced (in the equation's own context: its abstract mesh, ``compute_on``
and XLA metadata), and re-applies higher-order primitives (:func:`rebind`: ``jit`` /
``closed_call`` inlined, ``jax.checkpoint`` with its own policy, ``scan``, ``cond``,
``while_loop``) with their bodies evaluated under the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from .equation import Equation, closed
from .primitives import Kind


class Interpreter:
    """What a feature changes when a jaxpr is evaluated; the defaults change nothing."""

    def read(self, x: Any, atom: Var | Literal) -> Any:
        """``x``, the value of ``atom``, as a bound equation or the jaxpr's output receives it."""
        del atom
        return x

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any] | None:
        """``eqn``'s outputs for ``values`` (its inputs as the environment holds them, not
        :meth:`read`), or None to bind ``eqn`` to its read inputs as traced."""
        del eqn, values
        return None

    def scope(self, consts: dict[Var, Any]) -> MutableMapping[Var, Any]:
        """The environment a jaxpr with constants ``consts`` is evaluated in."""
        return dict(consts)


def value(env: MutableMapping[Var, Any], atom: Var | Literal) -> Any:
    """The value of a jaxpr atom: a literal's own, or a variable's from ``env``."""
    return atom.val if isinstance(atom, Literal) else env[atom]


def run(
    jaxpr: ClosedJaxpr | Jaxpr,
    args: Sequence[Any],
    rules: Interpreter,
    *,
    consts: Sequence[Any] | None = None,
    before: Callable[[int], None] | None = None,
) -> list[Any]:
    """``jaxpr`` applied to ``args`` under ``rules`` (``consts``: instead of its own
    constants); its outputs, each :meth:`Interpreter.read`. ``before(e)``, if given, is called
    before each of ``jaxpr``'s own equations ``e`` is evaluated (not those of bodies)."""
    jaxpr = closed(jaxpr)
    inner = jaxpr.jaxpr
    env = rules.scope(dict(zip(inner.constvars, jaxpr.consts if consts is None else consts)))
    env.update(zip(inner.invars, args))
    if before is None:
        evaluate(jaxpr, env, rules)
    else:
        for e in range(len(inner.eqns)):
            before(e)
            evaluate(jaxpr, env, rules, [e])
    return [rules.read(value(env, v), v) for v in inner.outvars]


def run_in_regions(
    jaxpr: ClosedJaxpr | Jaxpr,
    args: Sequence[Any],
    rules: Interpreter,
    regions: Sequence[tuple[int, int]],
    call_region: Callable[[Callable[[Interpreter, list[Any]], list[Any]], list[Any]], list[Any]],
) -> list[Any]:
    """:func:`run`, with each range ``(start, stop)`` of ``regions`` (ascending, disjoint
    equation numbers) evaluated as one call: ``call_region(body, inputs)`` returns the
    region's outputs, where ``inputs`` are the values the region reads from before it (as
    the environment holds them) and ``body(rules, inputs)`` evaluates its equations."""
    jaxpr = closed(jaxpr)
    inner = jaxpr.jaxpr
    env = rules.scope(dict(zip(inner.constvars, jaxpr.consts)))
    env.update(zip(inner.invars, args))
    done = 0
    for start, stop in regions:
        evaluate(jaxpr, env, rules, range(done, start))
        ins, outs = _region_io(inner, start, stop)

        def body(
            region_rules: Interpreter, values: list[Any], ins=ins, outs=outs, span=(start, stop)
        ):
            local = region_rules.scope(dict(zip(ins, values)))
            evaluate(jaxpr, local, region_rules, range(*span))
            return [local[v] for v in outs]

        env.update(zip(outs, call_region(body, [env[v] for v in ins])))
        done = stop
    evaluate(jaxpr, env, rules, range(done, len(inner.eqns)))
    return [rules.read(value(env, v), v) for v in inner.outvars]


def _region_io(jaxpr: Jaxpr, start: int, stop: int) -> tuple[list[Var], list[Var]]:
    """The variables equations ``start:stop`` of ``jaxpr`` read from before them, and those
    they define that later equations or the outputs read; each in first-seen order."""
    eqns = jaxpr.eqns
    defined = {v for e in eqns[start:stop] for v in e.outvars}
    ins: dict[Var, None] = {}
    for e in eqns[start:stop]:
        ins.update((v, None) for v in e.invars if isinstance(v, Var) and v not in defined)
    later = {v for e in eqns[stop:] for v in e.invars if isinstance(v, Var)}
    later.update(v for v in jaxpr.outvars if isinstance(v, Var))
    outs = [v for e in eqns[start:stop] for v in e.outvars if v in later]
    return list(ins), outs


def narrowest_cut(jaxpr: ClosedJaxpr | Jaxpr, lo: int, hi: int) -> int:
    """The equation number ``c`` in ``[lo, hi]`` where the fewest bytes cross from
    equations ``:c`` (and the inputs) to equations ``c:`` (and the outputs): where a
    region starting at ``c`` saves the least (the first of equals)."""
    inner = closed(jaxpr).jaxpr
    eqns = inner.eqns
    last_read: dict[Var, int] = {}  # the last equation reading each variable
    for e, eqn in enumerate(eqns):
        last_read.update((v, e) for v in eqn.invars if isinstance(v, Var))
    last_read.update((v, len(eqns)) for v in inner.outvars if isinstance(v, Var))
    defined = [*inner.constvars, *inner.invars, *(v for e in eqns[:lo] for v in e.outvars)]
    crossing = sum(_nbytes(v) for v in set(defined) if last_read.get(v, -1) >= lo)
    best, best_bytes = lo, crossing
    for c in range(lo + 1, hi + 1):
        eqn = eqns[c - 1]  # now before the cut: its outputs cross, its last reads end
        crossing += sum(_nbytes(v) for v in eqn.outvars if last_read.get(v, -1) >= c)
        ended = {v for v in eqn.invars if isinstance(v, Var) and last_read.get(v) == c - 1}
        crossing -= sum(_nbytes(v) for v in ended)
        if crossing < best_bytes:
            best, best_bytes = c, crossing
    return best


def _nbytes(v: Var) -> int:
    aval = v.aval
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def evaluate(
    jaxpr: ClosedJaxpr | Jaxpr,
    env: MutableMapping[Var, Any],
    rules: Interpreter,
    eqns: Iterable[int] | None = None,
) -> None:
    """Evaluates the equations of ``jaxpr`` numbered ``eqns`` (default: all), in order,
    under ``rules``, reading inputs from and writing outputs to ``env``."""
    all_eqns = closed(jaxpr).jaxpr.eqns
    for e in range(len(all_eqns)) if eqns is None else eqns:
        jaxpr_eqn = all_eqns[e]
        eqn = Equation(jaxpr_eqn)
        values = [value(env, v) for v in jaxpr_eqn.invars]
        with jaxpr_eqn.ctx.manager:
            outs = rules.apply(eqn, values)
            if outs is None:
                outs = bind(eqn, [rules.read(x, v) for x, v in zip(values, jaxpr_eqn.invars)])
        env.update(zip(jaxpr_eqn.outvars, outs))


def bind(eqn: Equation, args: Sequence[Any], params: dict[str, Any] | None = None) -> list:
    """``eqn``'s primitive applied to ``args`` with ``params`` (default: its own); always
    a list of outputs. Call it inside :func:`evaluate` (which enters the equation's
    context), i.e. from a rule."""
    jaxpr_eqn = eqn.jaxpr_eqn
    prim = jaxpr_eqn.primitive
    params = jaxpr_eqn.params if params is None else params
    out = prim.bind(*args, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


def bind_in_context(
    eqn: Equation, args: Sequence[Any], params: dict[str, Any] | None = None
) -> list:
    """:func:`bind` (with ``params``, default the equation's own), in ``eqn``'s own context
    (its abstract mesh, ``compute_on``, XLA metadata): for a rule that binds an equation
    later, outside :func:`evaluate` (e.g. again in a backward pass, or ``jax.vmap``-ed)."""
    with eqn.jaxpr_eqn.ctx.manager:
        return bind(eqn, args, params)


def binding_key(eqn: Equation) -> Hashable | None:
    """What :func:`bind_in_context` computes from ``eqn`` besides its operands' values: its
    primitive, parameters, literals (by their bytes), operand types and context. Two
    equations of equal key bound to the same operands give the same outputs. None where a
    parameter cannot be hashed."""
    e = eqn.jaxpr_eqn
    literals = tuple(_literal_key(a.val) if isinstance(a, Literal) else None for a in e.invars)
    types = tuple(str(a.aval) for a in e.invars)
    key = (e.primitive, tuple(sorted(e.params.items())), literals, types, e.ctx)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _literal_key(val: Any) -> tuple:
    """A literal's value, exactly (its bytes), as a hashable key."""
    array = np.asarray(val)
    return array.dtype.str, array.shape, array.tobytes()


REBINDS = frozenset({Kind.CALL, Kind.REMAT, Kind.SCAN, Kind.COND, Kind.WHILE})
"""The kinds :func:`rebind` re-applies (``custom_jvp`` / ``custom_vjp`` rules are opaque)."""


def rebind(eqn: Equation, args: list[Any], rules: Interpreter) -> list[Any]:
    """``eqn``'s higher-order primitive applied to ``args`` again, each body evaluated
    under ``rules``: a ``jit`` / ``closed_call`` inlined, a ``jax.checkpoint`` re-applied
    with its policy, and ``scan`` / ``cond`` / ``while_loop`` rebuilt with ``jax.lax``."""
    if eqn.kind is Kind.CALL:
        return run(eqn.call(), args, rules)
    if eqn.kind is Kind.REMAT:
        remat = eqn.remat()
        body = lambda *a: run(remat.body, a, rules)
        return jax.checkpoint(body, prevent_cse=remat.prevent_cse, policy=remat.policy)(*args)
    if eqn.kind is Kind.SCAN:
        return _scan(eqn, args, rules)
    if eqn.kind is Kind.COND:
        cond = eqn.cond(args)
        branches = [lambda *a, b=b: run(b, a, rules) for b in cond.branches]
        return jax.lax.switch(cond.index, branches, *cond.operands)
    if eqn.kind is Kind.WHILE:
        loop = eqn.while_loop(args)
        return jax.lax.while_loop(
            lambda c: run(loop.cond, [*loop.cond_consts, *c], rules)[0],
            lambda c: run(loop.body, [*loop.body_consts, *c], rules),
            loop.init,
        )
    raise ValueError(f"rebind: {eqn.kind} is not one of {sorted(k.value for k in REBINDS)}.")


class _InlineCalls(Interpreter):
    def apply(self, eqn: Equation, values: list[Any]) -> list[Any] | None:
        return run(eqn.call(), values, self) if eqn.kind is Kind.CALL else None


def inline_calls(jaxpr: ClosedJaxpr | Jaxpr) -> ClosedJaxpr:
    """``jaxpr`` traced again with every top-level and nested ``jit`` / ``closed_call``
    replaced by its body's equations (jax >= 0.11 keeps a ``jax.jit(inline=True)`` call,
    e.g. Optax's bias correction over the whole tree, as one equation; jax 0.10 inlined it
    when tracing)."""
    jaxpr = closed(jaxpr)
    avals = [v.aval for v in jaxpr.jaxpr.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(lambda *a: run(jaxpr, a, _InlineCalls()))(*specs)


def _scan(eqn: Equation, args: list[Any], rules: Interpreter) -> list[Any]:
    scan = eqn.scan(args)
    n_carry = len(scan.init)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = run(scan.body, [*scan.consts, *carry, *x], rules)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(
        step, scan.init, scan.xs, length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    return [*carry, *ys]
