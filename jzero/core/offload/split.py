"""An Optax update split into a global part and one part per parameter leaf.

Optax transformations are whole-tree functions. To stream an offloaded optimizer state
through the device leaf by leaf, :func:`split_update` traces ``tx.update(grads, state,
params)`` once and sorts its equations:

- the global part reads only gradients and the state leaves no parameter owns (e.g.
  Adam's count): constants, counters, and quantities over several leaves' gradients,
  such as the global norm ``clip_by_global_norm`` scales by;
- leaf i's part reads leaf i's gradient, parameter and state, and global values.

The split exists when no equation combines two leaves' parameters or state (an
equation combining gradients only moves, with its producers, to the global part).
Adam, AdamW, SGD, Adafactor and ``clip_by_global_norm`` chained before any of them
split; a clip of the *updates* after Adam (a norm over every leaf's moments) does not,
and :func:`split_update` then returns one bucket holding the whole update. Evaluating the
parts runs exactly the traced equations, so the result is the whole update's, bit for bit
as far as XLA compiles each equation the same way.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ...internal import interpret
from ...internal.equation import (
    ClosedJaxpr,
    equations,
    inputs,
    is_literal,
    outputs,
    trace,
    without_dead_equations,
)
from ...internal.moved import InternalMoved, warn_fallback
from ..plan import Plan, param_owners


class Bucket(NamedTuple):
    """The leaves one part of the update reads and writes (indices into the flat trees)."""

    params: tuple[int, ...]  # parameter (and gradient) leaves: their weights are copied in
    opt: tuple[int, ...]  # Optax-state leaves copied in and written back
    equations: tuple[int, ...]  # the traced equations this part evaluates, in order


class Split(NamedTuple):
    """``tx.update`` traced and cut into a global part and buckets.

    ``jaxpr`` takes ``(grads, opt_state, params)`` leaves and returns ``(updates,
    opt_state)`` leaves, named by leaf below. The ``shared`` state leaves
    are read by the global part and written from it; every other state leaf belongs to
    exactly one bucket.
    """

    jaxpr: ClosedJaxpr
    first: tuple[int, ...]  # the global part's equations, evaluated before any bucket
    buckets: tuple[Bucket, ...]
    shared: tuple[int, ...]  # state leaves no parameter owns (e.g. Adam's count)
    # the jaxpr's variables by leaf: inputs, then outputs
    grad_ins: tuple  # parameter leaf i's gradient
    state_ins: tuple  # Optax-state leaf j
    weight_ins: tuple  # parameter leaf i's weights, as tx.update reads them
    update_outs: tuple  # parameter leaf i's update
    state_outs: tuple  # Optax-state leaf j's new value

    @property
    def streams(self) -> bool:
        """Whether the update runs leaf by leaf (else one bucket holds the whole tree)."""
        return len(self.buckets) > 1

    @property
    def stored_ins(self) -> tuple:
        """The stored leaves' inputs: the Optax state's, then the weights'."""
        return self.state_ins + self.weight_ins


def _split(closed: ClosedJaxpr, first: tuple, buckets: tuple, shared: tuple, n: int) -> Split:
    """A :class:`Split` of ``closed``, whose inputs are ``n`` gradients, the Optax state and
    ``n`` weights, and whose outputs are ``n`` updates and the Optax state."""
    ins, outs = inputs(closed), outputs(closed)
    m = len(outs) - n
    return Split(
        closed,
        first,
        buckets,
        shared,
        grad_ins=tuple(ins[:n]),
        state_ins=tuple(ins[n : n + m]),
        weight_ins=tuple(ins[n + m :]),
        update_outs=tuple(outs[:n]),
        state_outs=tuple(outs[n:]),
    )


def _owners(tx: optax.GradientTransformation, plan: Plan, opt: Any) -> list[int] | None:
    """Per Optax-state leaf, the parameter leaf it belongs to (-1: none); None if unknown."""
    return param_owners(tx, plan.params_def, opt)


def _cut(jaxpr: Any, labels: list[int], hard: list[bool]) -> tuple[set[int], dict] | None:
    """Assigns each equation to the global part or to one leaf; None if impossible.

    ``labels[k]``: the leaf input k belongs to (-1: none); ``hard[k]``: it is a parameter
    or state leaf (which must never meet another leaf's). Returns the global equations
    and each variable's leaf (absent: global).
    """
    leaf: dict[Any, int] = {v: x for v, x in zip(inputs(jaxpr), labels) if x >= 0}
    is_hard = {v for v, h in zip(inputs(jaxpr), hard) if h}
    made_by: dict[Any, int] = {}
    first: set[int] = set()
    eqns = equations(jaxpr)

    def promote(e: int) -> bool:  # e and its producers to the global part
        if e in first:
            return True
        eqn = eqns[e]
        if any(v in is_hard for v in eqn.outputs):
            return False
        first.add(e)
        for v in eqn.outputs:
            leaf.pop(v, None)
        return all(promote(made_by[v]) for v in eqn.variables if v in made_by and v in leaf)

    for e, eqn in enumerate(eqns):
        ins = eqn.variables
        owners = {leaf[v] for v in ins if v in leaf}
        made_by.update(dict.fromkeys(eqn.outputs, e))
        if len(owners) <= 1 and owners:
            leaf.update(dict.fromkeys(eqn.outputs, owners.pop()))
            if any(v in is_hard for v in ins):
                is_hard.update(eqn.outputs)
        elif not owners:
            first.add(e)
        else:
            if any(v in is_hard for v in ins if v in leaf and v not in made_by):
                return None  # two leaves' parameters or state meet
            first.add(e)
            if not all(promote(made_by[v]) for v in ins if v in made_by and v in leaf):
                return None
    return first, leaf


@functools.lru_cache(maxsize=32)
def split_update(tx: optax.GradientTransformation, plan: Plan) -> Split:
    """``tx.update`` for ``plan``'s trees, cut into a global part and per-leaf buckets;
    one bucket holding the whole update (with a warning) where a JAX internal the split
    reads has moved."""
    try:
        return _split_update(tx, plan)
    except InternalMoved as moved:
        state = sum(math.prod(s.layout.padded) * s.dtype.itemsize for s in plan.opt)
        warn_fallback(
            "the offloaded update's split into per-leaf buckets",
            moved,
            "the whole update runs as one bucket (every optimizer-state leaf moved at once)",
            f"up to {state:,} bytes of optimizer state per device in flight at once "
            "instead of one leaf's",
        )
        return _whole(trace(tx.update, *_specs(plan), _specs(plan)[0]), plan)


def _specs(plan: Plan) -> tuple[Any, Any]:
    """The parameter (fp32) and Optax-state trees ``tx.update`` is traced on."""
    params = [jax.ShapeDtypeStruct(s.layout.shape, jnp.float32) for s in plan.params]
    opt = [jax.ShapeDtypeStruct(s.layout.shape, s.dtype) for s in plan.opt]
    return jax.tree.unflatten(plan.params_def, params), jax.tree.unflatten(plan.opt_def, opt)


def _whole(closed: ClosedJaxpr, plan: Plan) -> Split:
    """The whole update as one bucket."""
    n, m = len(plan.params), len(plan.opt)
    every = tuple(range(len(equations(closed))))
    return _split(closed, (), (Bucket(tuple(range(n)), tuple(range(m)), every),), (), n)


def _split_update(tx: optax.GradientTransformation, plan: Plan) -> Split:
    trees = _specs(plan)
    closed = interpret.inline_calls(trace(tx.update, trees[0], trees[1], trees[0]))
    closed = without_dead_equations(closed)
    n, eqns = len(plan.params), equations(closed)
    whole = _whole(closed, plan)
    owners = _owners(tx, plan, trees[1])
    if owners is None or n < 2:
        return whole
    labels = [*range(n), *owners, *range(n)]
    hard = [False] * n + [o >= 0 for o in owners] + [True] * n
    cut = _cut(closed, labels, hard)
    if cut is None:
        return whole
    first, leaf = cut
    writes = [*range(n), *owners]  # the leaf each output belongs to (-1: shared)
    outs = [(v, w) for v, w in zip(outputs(closed), writes) if not is_literal(v)]
    if any(v in leaf and leaf[v] != w for v, w in outs):  # e.g. a state leaf written
        return whole  # from another leaf's values
    eqn_leaf = [leaf.get(eqn.outputs[0]) if eqn.outputs else None for eqn in eqns]
    buckets = tuple(
        Bucket(
            (i,),
            tuple(j for j, o in enumerate(owners) if o == i),
            tuple(e for e, x in enumerate(eqn_leaf) if x == i and e not in first),
        )
        for i in range(n)
    )
    shared = tuple(j for j, o in enumerate(owners) if o < 0)
    return _split(closed, tuple(sorted(first)), buckets, shared, n)


def evaluate(split: Split, eqns: tuple[int, ...], env: dict) -> None:
    """Evaluates the given equations of ``split.jaxpr`` in order, reading and writing
    ``env``: each exactly as traced."""
    interpret.evaluate(split.jaxpr, env, interpret.Interpreter(), eqns)
