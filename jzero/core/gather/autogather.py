"""Stage 3's default gathering: each parameter gathered where the loss consumes it.

Without ``manual_gather``, stage 3 must hand the loss function full parameters. Gathering
them all up front holds the whole model on every device. Instead the loss is traced once
(``jax.make_jaxpr``) on gathered parameters and then re-run equation by equation with each
``jzero.gather`` deferred until the first equation that reads its result:

- a ``lax.scan`` (``nn.scan``, ``nnx.scan``) that takes a stacked parameter as one of its
  scanned inputs (``xs``) gets the sharded stack instead, and gathers each layer's slice
  inside its body: one layer gathered at a time, forward and (under the step's remat
  policy, which never saves a gathered parameter) backward;
- a ``jax.jit`` / ``closed_call`` is inlined and a ``jax.checkpoint`` (``nn.remat``) is
  re-applied with its own policy (plus "never save a gathered parameter"), so that
  parameters passed through them stay deferred down to their scans;
- any other use gathers the whole parameter there, once.

Every other equation is bound as traced, so the numerics are the user's own: only where
and how often the all-gathers happen changes (docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.extend.core import primitives as prims

from ..comm.collectives import Sharded, gather, gather_each, saves_no_gathered
from ..jaxprs import bind
from .prefetch import can_prefetch, prefetched_scan
from .remat import remat_layer


class _Deferred:
    """A parameter not gathered yet: its :class:`Sharded` handle (a whole leaf, or one
    scanned layer of a stacked leaf), gathered once on first use wherever that is: an
    inlined ``jit`` body has an environment of its own, and a tied embedding used inside
    and outside one must still be gathered (and its gradient reduce-scattered) once."""

    def __init__(self, handle: Sharded):
        self.handle, self._full = handle, None

    def full(self) -> Any:
        if self._full is None:
            self._full = self.handle.gather()
        return self._full


def gather_where_used(fn: Callable[..., Any], *, prefetch: bool = False) -> Callable[..., Any]:
    """``fn(params, *args)`` for ``params`` holding :class:`Sharded` handles, each gathered
    where ``fn`` uses it (per layer inside scans over stacked parameters).

    Equal to ``fn(jzero.gather(params), *args)`` in value and gradient.
    """

    def run(params: Any, *args: Any) -> Any:
        is_handle = lambda x: isinstance(x, Sharded)
        traced, out_shape = jax.make_jaxpr(lambda p, *a: fn(gather_each(p), *a), return_shape=True)(
            params, *args
        )
        flat_in = jax.tree.leaves((params, args))
        # Each handle flattens to (sink, value): its gather is the custom_vjp_call that
        # reads exactly those two inputs.
        handles, at = {}, 0
        for leaf in jax.tree.leaves(params, is_leaf=is_handle):
            if is_handle(leaf):
                handles[traced.jaxpr.invars[at]] = leaf
                at += 2
            else:
                at += 1
        out = _run(traced.jaxpr, traced.consts, flat_in, handles, prefetch=prefetch)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return run


def _run(
    jaxpr: core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    handles: dict | None = None,
    *,
    prefetch: bool = False,
) -> list[Any]:
    """``jax.core.eval_jaxpr`` with deferred gathers (see the module docstring)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def peek(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    def read(v: Any) -> Any:
        x = peek(v)
        if isinstance(x, _Deferred):  # first use that needs the full value: gather it here
            x = env[v] = x.full()
        return x

    for eqn in jaxpr.eqns:
        if handles and eqn.primitive is prims.custom_vjp_call_p and eqn.invars[0] in handles:
            env[eqn.outvars[0]] = _Deferred(handles[eqn.invars[0]])  # jzero.gather: defer
            continue
        deferred = any(isinstance(peek(v), _Deferred) for v in eqn.invars)
        if deferred and eqn.primitive is prims.scan_p:
            outs = _scan(eqn, [peek(v) for v in eqn.invars], read, prefetch)
        elif deferred and eqn.primitive in (prims.jit_p, prims.closed_call_p):
            inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
            outs = _run(inner.jaxpr, inner.consts, [peek(v) for v in eqn.invars], prefetch=prefetch)
        elif deferred and eqn.primitive is prims.remat_p:
            outs = _checkpoint(eqn, [peek(v) for v in eqn.invars])
        else:
            outs = bind(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn: Any, operands: list[Any], read: Callable[[Any], Any], prefetch: bool) -> list[Any]:
    """A ``scan`` whose deferred scanned inputs are sliced sharded and gathered per step."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    body: core.ClosedJaxpr = p["jaxpr"]
    consts = [read(v) for v in eqn.invars[:n_consts]]  # used by every step: gathered once
    init = [read(v) for v in eqn.invars[n_consts : n_consts + n_carry]]
    # A stack sharded along its stacked axis cannot be sliced per step: gathered whole.
    sliceable = lambda x: isinstance(x, _Deferred) and x.handle.layout.axis(x.handle.value) > 0
    xs = [
        x if sliceable(x) else read(v)
        for x, v in zip(operands[n_consts + n_carry :], eqn.invars[n_consts + n_carry :])
    ]
    scanned = [x.handle if isinstance(x, _Deferred) else x for x in xs]
    lazy = [isinstance(x, _Deferred) for x in xs]

    if prefetch and any(lazy) and can_prefetch(body.consts, consts, init, scanned):
        handles = [x for x, d in zip(scanned, lazy) if d]
        others = [x for x, d in zip(scanned, lazy) if not d]
        n_body = len(body.consts)

        def layer(all_consts, carry, params, x_others):
            params, x_others = iter(params), iter(x_others)
            slices = [next(params) if d else next(x_others) for d in lazy]
            outs = _run(body.jaxpr, all_consts[:n_body], [*all_consts[n_body:], *carry, *slices])
            return outs[:n_carry], outs[n_carry:]

        carry, ys = prefetched_scan(
            layer, [*body.consts, *consts], init, handles, others,
            length=p["length"], reverse=p["reverse"],
        )  # fmt: skip
        return [*carry, *ys]

    def step(carry, x_slices):
        if any(x.handle.bucket for x in xs if isinstance(x, _Deferred)):
            slices = gather(list(x_slices))  # the layer's leaves in one flat collective
        else:  # each gathered where the step first uses it
            slices = [_Deferred(s) if d else s for s, d in zip(x_slices, lazy)]
        outs = _run(body.jaxpr, body.consts, [*consts, *carry, *slices], prefetch=prefetch)
        return outs[:n_carry], outs[n_carry:]

    # Rematerialised per step: backward gathers each layer again inside its own loop
    # step (and keeps the step's activations), instead of a recomputing forward loop
    # stacking every layer's gathered parameters for the backward loop.
    step = jax.checkpoint(
        step, policy=saves_no_gathered(jax.checkpoint_policies.everything_saveable)
    )
    carry, ys = jax.lax.scan(
        step, init, scanned, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _checkpoint(eqn: Any, operands: list[Any]) -> list[Any]:
    """A ``jax.checkpoint`` region (a layer the user rematerialises) taking deferred
    parameters: run as :func:`jzero.remat_layer` with the region's policy, so the region
    gathers them once its inputs exist and again in backward once its output cotangents
    exist (as a plain checkpoint does on GPU, but also on XLA:CPU, see remat.py)."""
    p = eqn.params
    inner: core.Jaxpr = p["jaxpr"]
    lazy = [isinstance(x, _Deferred) for x in operands]
    handles = [x.handle for x in operands if isinstance(x, _Deferred)]
    others = [x for x in operands if not isinstance(x, _Deferred)]

    def region(params, *rest):
        params, rest = iter(params), iter(rest)
        return _run(inner, (), [next(params) if d else next(rest) for d in lazy])

    return remat_layer(region, policy=p["policy"])(handles, *others)
