"""Same-shaped leaves updated as one stack: an Optax update's per-leaf work, batched.

An unrolled model's weight matrices have no axis their matrix optimizer leaves alone, so
there is no axis to lay them out along (:mod:`jzero.core.update_layout`). Leaves of one
shape that the update treats alike can be *stacked* instead: the stack's leading axis is
then the batch axis, each device holds whole matrices, its 1/N of them, and the update's
mixing work (Muon's Newton-Schulz) runs once, ``jax.vmap``-ed over the stack.

:func:`plan_batching` reads the update's jaxpr (``jit`` calls inlined). An equation is
*private* to one leaf of a bucket when it depends on that leaf's inputs and on no other
bucket leaf's (results of equations over several leaves, e.g. a global norm, count as
shared values). Private equations get a canonical key: primitive, parameters, operand
types and their operands' keys (a leaf's own inputs by role, shared values by identity).
A bucket is batched only when every leaf's private equations have the same keys, i.e.
the update does the same thing to each. Within it, an equation that mixes its operands'
axes (:mod:`.mixed_axes`), or reads a value only the stack holds, runs on the stack; the
elementwise work before (a momentum) runs on each leaf as stored.

:func:`run_batching` evaluates the jaxpr by demand from its outputs: the first private
equation of a key met runs for the whole bucket at once, the others read their slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from .equation import Equation
from .interpret import _literal_key, bind_in_context, binding_key, inline_calls
from .mixed_axes import equation_mixes
from .moved import InternalMoved
from .primitives import Kind

Key = Hashable


@dataclasses.dataclass
class _Private:
    bucket: int
    leaf: int
    keys: tuple[Key, ...]  # per output
    operands: tuple[Key, ...]  # per operand
    batched: bool


@dataclasses.dataclass
class Batching:
    """Which equations of an update run on stacks, and how the leaves line up."""

    jaxpr: ClosedJaxpr  # the update, calls inlined
    private: dict[int, _Private]  # equation number -> what it is
    slots: dict[tuple[int, Key], list[Var]]  # (bucket, key) -> the variable of each leaf
    inputs: dict[tuple[int, Key], list[int]]  # (bucket, ('in', role)) -> each leaf's input
    stacked: set[tuple[int, Key]]  # the (bucket, key)s only a stack holds


def plan_batching(
    fn: Callable[..., Any], args: Sequence[Any], groups: Sequence[Sequence[Sequence[int]]]
) -> Batching | None:
    """How to run ``fn`` (on the flat ``args``) with ``groups`` batched: per bucket, per
    leaf, the flat input numbers of its roles (gradient, parameter, owned state, in the
    same order for every leaf). None where no bucket's leaves are treated alike. Raises
    :class:`.moved.InternalMoved` where an equation's form this reads has moved."""
    try:
        return _plan(fn, args, groups)
    except (KeyError, AttributeError) as missing:
        raise InternalMoved(f"an equation's field or parameter ({missing!r})", "is gone") from None


def _plan(fn: Callable[..., Any], args: Sequence[Any], groups: Sequence) -> Batching | None:
    jaxpr = inline_calls(jax.make_jaxpr(lambda *a: fn(*a))(*args))
    inner = jaxpr.jaxpr
    owner: dict[Var, tuple[int, int]] = {}  # a leaf's input or private value -> (bucket, leaf)
    key: dict[Var, Key] = {}
    inputs: dict[tuple[int, Key], list[int]] = {}
    for b, leaves in enumerate(groups):
        for j, roles in enumerate(leaves):
            for r, k in enumerate(roles):
                v = inner.invars[k]
                owner[v], key[v] = (b, j), ("in", r)
                inputs.setdefault((b, ("in", r)), [0] * len(leaves))[j] = k
    private: dict[int, _Private] = {}
    stacked: set[Var] = set()
    failed: set[int] = set()
    intern: dict[Any, int] = {}
    for k, v in enumerate(inner.invars):
        key.setdefault(v, ("input", k))
    for e, eqn in enumerate(inner.eqns):
        found = {owner[v] for v in eqn.invars if isinstance(v, Var) and v in owner}
        base = _base_key(eqn)
        operands = tuple(_operand_key(v, key) for v in eqn.invars)
        if len(found) > 1 or base is None:  # over several leaves: a value of its own
            key.update((v, ("shared", id(v))) for v in eqn.outvars)
            failed.update(b for b, _ in found if base is None)
            continue
        keys = tuple(
            intern.setdefault((base, operands, k), len(intern)) for k in range(len(eqn.outvars))
        )
        key.update(zip(eqn.outvars, keys))
        if not found:
            continue  # a value no bucket leaf reaches, named by how it is computed
        b, j = next(iter(found))
        reads_stack = any(isinstance(v, Var) and v in stacked for v in eqn.invars)
        batched = reads_stack or _mixes(eqn, owner)
        private[e] = _Private(b, j, keys, operands, batched)
        for v in eqn.outvars:
            owner[v] = (b, j)
            if batched:
                stacked.add(v)
    slots = _slots(inner, private, groups)
    failed |= _unlike(private, groups)
    if groups and len(failed) == len(groups):
        return None
    private = {e: p for e, p in private.items() if p.bucket not in failed}
    on_stack = {(p.bucket, k) for p in private.values() if p.batched for k in p.keys}
    return Batching(jaxpr, private, slots, inputs, on_stack)


def _base_key(eqn: Any) -> Key | None:
    """:func:`.interpret.binding_key` with the bodies of higher-order primitives (a scan's,
    traced once per leaf) compared by their text and constants, not by identity."""
    params = {k: _body_key(v) for k, v in eqn.params.items()}
    twin = eqn.replace(params=params) if hasattr(eqn, "replace") else None
    if twin is None:
        return None
    try:
        return binding_key(Equation(twin))
    except Exception:  # noqa: BLE001 -- a parameter that cannot be compared
        return None


def _body_key(v: Any) -> Any:
    if isinstance(v, tuple | list) and v and all(isinstance(x, ClosedJaxpr | Jaxpr) for x in v):
        return tuple(_body_key(x) for x in v)
    if isinstance(v, ClosedJaxpr):
        consts = tuple(_literal_key(np.asarray(c)) for c in v.consts)
        return ("jaxpr", str(v.jaxpr), consts)
    if isinstance(v, Jaxpr):
        return ("jaxpr", str(v), ())
    return v


def _operand_key(v: Any, key: dict[Var, Key]) -> Key:
    if isinstance(v, Literal):
        return ("literal", repr(v.val), str(v.aval))
    return key.get(v, ("const", id(v)))


def _mixes(eqn: Any, owner: dict) -> bool:
    """Whether the equation mixes the axes of its leaf's values (:mod:`.mixed_axes`)."""
    mine = [isinstance(v, Var) and v in owner for v in eqn.invars]
    return equation_mixes(Equation(eqn), mine)


def _slots(inner: Any, private: dict[int, _Private], groups: Sequence) -> dict:
    slots: dict[tuple[int, Key], list[Var]] = {}
    for e, p in private.items():
        for v, k in zip(inner.eqns[e].outvars, p.keys):
            slots.setdefault((p.bucket, k), [None] * len(groups[p.bucket]))[p.leaf] = v
    return slots


def _unlike(private: dict[int, _Private], groups: Sequence) -> set[int]:
    """The buckets whose leaves' private equations differ (by key), or run on the stack
    for one leaf and not another."""
    seen: dict[int, list[set]] = {b: [set() for _ in g] for b, g in enumerate(groups)}
    for p in private.values():
        seen[p.bucket][p.leaf].add((p.keys, p.batched))
    return {b for b, per in seen.items() if any(s != per[0] for s in per)}


def _rolled(eqn: Any) -> dict[str, Any]:
    """``eqn``'s parameters, a ``lax.scan``'s with ``unroll=1``: Optax's Newton-Schulz
    unrolls its five iterations, and XLA:CPU then keeps each one's buffers (19 MB of
    temporaries for 3 MB of matrices, 2 MB rolled); the same operations either way."""
    params = eqn.params
    if Equation(eqn).kind is Kind.SCAN and params.get("unroll", 1) not in (1, False):
        return {**params, "unroll": 1}
    return params


class _Slot:
    """A private value that only its bucket's stack holds: slot ``leaf`` of ``key``."""

    __slots__ = ("key", "leaf")

    def __init__(self, key: tuple[int, Key], leaf: int):
        self.key, self.leaf = key, leaf


def run_batching(
    batching: Batching,
    args: Sequence[Any],
    stack: Callable[[int, list[Any]], Any],
    unstack: Callable[[int, Any], list[Any]],
) -> list[Any]:
    """The update's outputs for the flat ``args``, each bucket's private work batched.
    ``stack(bucket, values)`` lays the leaves' values out as one stack (leading axis: the
    leaves, then padding), ``unstack(bucket, stacked)`` gives them back one per leaf."""
    return _Run(batching, args, stack, unstack).outputs()


class _Run:
    def __init__(self, batching: Batching, args: Sequence[Any], stack: Callable, unstack: Callable):
        inner = batching.jaxpr.jaxpr
        self.b, self.stack_fn, self.unstack_fn = batching, stack, unstack
        self.env: dict[Var, Any] = dict(zip(inner.constvars, batching.jaxpr.consts))
        self.env.update(zip(inner.invars, args))
        self.defined = {v: e for e, eqn in enumerate(inner.eqns) for v in eqn.outvars}
        self.stacks: dict[tuple[int, Key], Any] = {}
        self.unstacked: dict[tuple[int, Key], list[Any]] = {}

    def outputs(self) -> list[Any]:
        return [self.value(v) for v in self.b.jaxpr.jaxpr.outvars]

    def value(self, atom: Any) -> Any:
        """The value of ``atom`` as an unbatched equation or the output reads it."""
        if isinstance(atom, Literal):
            return atom.val
        self.compute(atom)
        x = self.env[atom]
        if isinstance(x, _Slot):
            if x.key not in self.unstacked:
                self.unstacked[x.key] = self.unstack_fn(x.key[0], self.stacks[x.key])
            return self.unstacked[x.key][x.leaf]
        return x

    def compute(self, target: Var) -> None:
        """Evaluates the equations ``target`` depends on, by demand (no recursion)."""
        todo = [target]
        while todo:
            v = todo[-1]
            if v in self.env:
                todo.pop()
                continue
            missing = [u for u in self._needs(self.defined[v]) if u not in self.env]
            if missing:
                todo.extend(missing)
                continue
            self.evaluate(self.defined[v])
            todo.pop()

    def _needs(self, e: int) -> list[Var]:
        """What equation ``e`` reads; for a batched one, what its stack is made of: each
        leaf's twin of an operand computed per leaf, the operand itself where a stack
        holds it (its own equation makes the stack)."""
        eqn = self.b.jaxpr.jaxpr.eqns[e]
        p = self.b.private.get(e)
        if p is None or not p.batched:
            return [v for v in eqn.invars if isinstance(v, Var)]
        needs = []
        for v, k in zip(eqn.invars, p.operands):
            if not isinstance(v, Var) or (p.bucket, k) in self.stacks:
                continue
            twins = self.b.slots.get((p.bucket, k))
            per_leaf = twins is not None and (p.bucket, k) not in self.b.stacked
            needs.extend(twins if per_leaf else [v])
        return needs

    def evaluate(self, e: int) -> None:
        eqn = self.b.jaxpr.jaxpr.eqns[e]
        p = self.b.private.get(e)
        if p is None or not p.batched:
            args = [self.value(v) for v in eqn.invars]
            outs = bind_in_context(Equation(eqn), args, _rolled(eqn))
            self.env.update(zip(eqn.outvars, outs))
            return
        if (p.bucket, p.keys[0]) not in self.stacks:
            self.run_stacked(eqn, p)
        for v, k in zip(eqn.outvars, p.keys):
            self.env[v] = _Slot((p.bucket, k), p.leaf)

    def run_stacked(self, eqn: Any, p: _Private) -> None:
        """``eqn`` for every leaf of its bucket at once, ``jax.vmap``-ed over the stack."""
        operands, axes = [], []
        for v, k in zip(eqn.invars, p.operands):
            stacked = self.stacked(p.bucket, v, k)
            operands.append(self.value(v) if stacked is None else stacked)
            axes.append(None if stacked is None else 0)
        body = lambda *xs: bind_in_context(Equation(eqn), list(xs), _rolled(eqn))
        outs = jax.vmap(body, in_axes=axes)(*operands)
        for k, out in zip(p.keys, outs):
            self.stacks[(p.bucket, k)] = out

    def stacked(self, bucket: int, v: Any, k: Key) -> Any | None:
        """The stack of ``v``'s twins (None for a shared value or literal)."""
        if isinstance(v, Literal):
            return None
        if (bucket, k) in self.stacks:
            return self.stacks[(bucket, k)]
        twins = self.b.slots.get((bucket, k))
        if twins is None and (bucket, k) in self.b.inputs:
            inner = self.b.jaxpr.jaxpr
            twins = [inner.invars[i] for i in self.b.inputs[(bucket, k)]]
        if twins is None:
            return None
        self.stacks[(bucket, k)] = self.stack_fn(bucket, [self.value(t) for t in twins])
        return self.stacks[(bucket, k)]
