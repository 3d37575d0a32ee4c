"""Parameters not gathered yet, and gathering at each use: stage 3 for unrolled models.

Stage 3's default gathering (:mod:`.autogather`) re-runs the loss with each ``jzero.gather``
deferred (a :class:`Deferred`). Inside scans and checkpointed layers the loop step or the
layer gathers it. Elsewhere -- an unrolled model: a Python loop over a list of layers,
``params['blocks'][i]``, Flax Linen / NNX modules called one after another -- a parameter
used once is gathered *at its use* (:func:`use`): the equation that consumes it (say the
``dot_general`` of ``x @ w``) becomes a :func:`jzero.remat_layer` of its own, which
gathers ``w`` once ``x`` exists and, in backward, again once the cotangent of ``x @ w``
exists. So about one layer's gathered parameters are alive at a time, forward and
backward; every activation is kept (nothing is recomputed but the gather and the
reshapes or casts of the weight, FSDP's trade); each weight is all-gathered twice per step.
The layers of an unrolled model repeat the same uses: each kind of use is one ``jit``,
traced and differentiated once, that every layer calls.
Without those data dependencies XLA:CPU merges the backward gather into the forward one
(common-subexpression elimination) and holds every gathered weight through backward.

What a parameter feeds before its use (a reshape, a transpose, a cast) is a
:class:`Derived` value: computed again inside the use from the gathered parameter, and
named ``GATHERED`` so that no remat policy saves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ...internal.equation import Equation, is_literal
from ...internal.interpret import bind_in_context, binding_key
from ..comm.collectives import GATHERED
from ..comm.gatherer import Sharded
from .remat import remat_layer


class Deferred:
    """A parameter not gathered yet: its :class:`Sharded` handle (a whole leaf, or one layer
    of a stacked leaf).

    Attributes:
        handle: the parameter's handle.
        key: its number among the deferred parameters of the loss's top level, in the order
            they appear (the same in every run of one jaxpr); None inside a loop body.
        per_use: gathered inside its one use (:func:`use`); else where first read, once,
            and held from there (:meth:`full`: a parameter used more than once).
    """

    def __init__(self, handle: Sharded, *, key: int | None = None, per_use: bool = False):
        self.handle, self.key, self.per_use = handle, key, per_use
        self._full = None
        self._layers: list[Sharded] | None = None  # the stack's layers, split once

    def full(self) -> Any:
        """The parameter gathered (once: an inlined ``jit`` body has an environment of its
        own, and a tied embedding used inside and outside one is still gathered once)."""
        if self._full is None:
            self._full = self.handle.gather()
        return self._full

    def indexable(self) -> bool:
        """Whether one index of the leading axis (a layer of a stack) can be taken from the
        shards: the leaf is sharded along another axis."""
        return self.handle.layout.axis(self.handle.value) > 0

    def layer(self, i: Any) -> Sharded:
        """The handle of ``x[i:i+1]`` (leading axis) of this parameter ``x``: its shards'.
        A static ``i`` takes a piece of one ``lax.split`` of the whole stack (whose
        transpose concatenates the layers' gradients), a traced one a ``dynamic_slice``."""
        if not isinstance(i, int):
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0)
            return jax.tree.map(take, self.handle)
        if self._layers is None:
            treedef = jax.tree.structure(self.handle)
            split = lambda a: jax.lax.split(a, [1] * a.shape[0], axis=0)
            pieces = zip(*(split(a) for a in jax.tree.leaves(self.handle)))
            self._layers = [jax.tree.unflatten(treedef, p) for p in pieces]
        return self._layers[i]


class Derived:
    """Output ``index`` of equation ``eqn`` applied to ``inputs``: each a per-use
    :class:`Deferred`, a :class:`Derived` or a literal. Computed where it is used."""

    def __init__(self, eqn: Equation, inputs: list[Any], index: int):
        self.eqn, self.inputs, self.index = eqn, inputs, index
        self.bases = _bases(inputs)  # the deferred parameters it is computed from
        self._value = None

    def compute(self, full: dict[int, Any]) -> Any:
        """Its value, from ``full``: each of :attr:`bases` gathered, by ``id``."""
        args = [value_from(x, full) for x in self.inputs]
        out = bind_in_context(self.eqn, args)[self.index]
        return checkpoint_name(out, GATHERED) if jnp.issubdtype(out.dtype, jnp.inexact) else out

    def value(self) -> Any:
        """Its value from its bases gathered where first read (:meth:`Deferred.full`)."""
        if self._value is None:
            self._value = self.compute({id(b): b.full() for b in self.bases})
        return self._value


def is_lazy(x: Any) -> bool:
    """Whether ``x`` is gathered at its use: a per-use parameter, or computed from some."""
    return isinstance(x, Derived) or (isinstance(x, Deferred) and x.per_use)


def value_from(x: Any, full: dict[int, Any]) -> Any:
    if isinstance(x, Deferred):
        return full[id(x)]
    return x.compute(full) if isinstance(x, Derived) else x


def _bases(values: list[Any]) -> list[Deferred]:
    """The per-use parameters ``values`` are computed from, each once, in order."""
    out: dict[int, Deferred] = {}
    for x in values:
        for b in x.bases if isinstance(x, Derived) else [x] if is_lazy(x) else []:
            out.setdefault(id(b), b)
    return list(out.values())


def use(
    eqn: Equation, values: list[Any], read: Callable[[Any], Any], uses: dict | None = None
) -> list[Any]:
    """``eqn`` applied to ``values``, some of them lazy (:func:`is_lazy`).

    Computed from lazy values and literals alone, its outputs are :class:`Derived`.
    Otherwise ``eqn`` is a use: a :func:`jzero.remat_layer` that gathers the lazy values'
    parameters there and again in backward, keeping only its inputs (the gathered
    parameters and what is derived from them are never saved; ``eqn``'s output is, by
    the step's policy); every other value is ``read`` and passed to it.

    ``uses``: the uses built so far, by :func:`_use_key`. A use equal to an earlier one
    (the same equation of another layer of an unrolled model) calls the earlier one's
    ``jit``, so JAX traces, differentiates and lowers it once, not once per layer.
    """
    if (derived := derive(eqn, values)) is not None:
        return derived
    static = [is_literal(a) or is_lazy(x) for x, a in zip(values, eqn.inputs)]
    bases = _bases(values)
    key = None if uses is None else _use_key(eqn, values, static, bases)
    bound = lambda inputs: bind_in_context(eqn, inputs)
    if key is None:
        return gathered_at(bound, values, static, read)
    if key not in uses:
        uses[key] = jax.jit(remat_layer(_region(bound, values, static, bases)))
    given = [read(x) for x, s in zip(values, static) if not s]
    return uses[key]([b.handle for b in bases], *given)


def _use_key(eqn: Equation, values: list[Any], static: list[bool], bases: list) -> Any:
    """What a use computes, given its inputs: ``eqn``'s binding key, and per value whether it
    is passed in or which of ``bases`` it is computed from, and how. None where an
    equation's key is unknown."""
    position = {id(b): i for i, b in enumerate(bases)}

    def of(x: Any, passed: bool) -> Any:
        if passed:
            return "given"
        if isinstance(x, Deferred):
            return ("parameter", position[id(x)])
        if isinstance(x, Derived):
            inner = tuple(of(y, False) for y in x.inputs)
            sig = binding_key(x.eqn)
            return None if sig is None or None in inner else (sig, x.index, inner)
        return "literal"  # in its equation's key

    keys = tuple(of(x, not s) for x, s in zip(values, static))
    sig = binding_key(eqn)
    return None if sig is None or None in keys else (sig, keys)


def derive(eqn: Equation, values: list[Any]) -> list[Derived] | None:
    """``eqn``'s outputs as :class:`Derived` values if ``eqn`` computes them from lazy
    values and literals alone (a reshape, cast or transpose of a parameter), else None."""
    if not all(is_literal(a) or is_lazy(x) for x, a in zip(values, eqn.inputs)):
        return None
    return [Derived(eqn, values, k) for k in range(len(eqn.outputs))]


def gathered_at(
    fn: Callable[[list[Any]], list[Any]],
    values: list[Any],
    static: list[bool],
    read: Callable[[Any], Any],
    policy: Callable[..., Any] | None = None,
) -> list[Any]:
    """``fn(values)`` as a :func:`jzero.remat_layer` (with ``policy``) that gathers the
    parameters of the lazy values among them inside, forward and again in backward.
    ``static``: which values are lazy or constants (computed inside, never passed); the
    others are ``read`` and passed in."""
    bases = _bases(values)
    layer = remat_layer(_region(fn, values, static, bases), policy=policy)
    return layer([b.handle for b in bases], *(read(x) for x, s in zip(values, static) if not s))


def _region(fn: Callable, values: list[Any], static: list[bool], bases: list) -> Callable:
    """``region(full_params, *args)``: ``fn`` of ``values``, the lazy ones computed from
    ``full_params`` (``bases`` gathered, in order) and the others given as ``args``."""
    given = [i for i, s in enumerate(static) if not s]

    def region(full_params: list, *args: Any) -> list:
        full = {id(b): p for b, p in zip(bases, full_params)}
        inputs = [value_from(x, full) if s else None for x, s in zip(values, static)]
        for i, a in zip(given, args):
            inputs[i] = a
        return fn(inputs)

    return region
