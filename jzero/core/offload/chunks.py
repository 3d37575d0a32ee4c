"""Chunks of an elementwise update bucket: the device memory bound of optimizer offload.

An offloaded update streams one parameter leaf's state through the device at a time
(:mod:`.update`). With layers stacked by ``nn.scan`` one leaf holds every layer, so one
bucket is a large share of the whole state. A bucket whose equations are all elementwise
(Adam, AdamW, SGD, momentum, the per-leaf part of ``clip_by_global_norm``) computes each
element from the same element of its inputs and from global scalars, so it can run on
static slices of the leaf: chunks of at most ``Offload.stream_chunk`` elements along one
axis that no mesh axis shards (slicing a sharded axis would make XLA communicate), as
DeepSpeed's ``sub_group_size`` bounds its optimizer sub-steps. Each chunk evaluates the
bucket's own traced equations (a ``broadcast_in_dim`` of a scalar gets the chunk's
shape), so the result is the whole bucket's, element for element.

Elementwise is decided from the jaxpr: every equation's primitive is elementwise
(:data:`jzero.internal.primitives.ELEMENTWISE`, or a ``jit`` of such equations),
``broadcast_in_dim`` only broadcasts a scalar, and every non-scalar operand and result
has the leaf's shape. Anything else (Adafactor's factored moments, a per-leaf norm) stays
whole. A chunk is evaluated by jzero's jaxpr interpreter (:mod:`jzero.internal.interpret`)
under :class:`_Chunking`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, NamedTuple

import jax

from ...internal import interpret
from ...internal.equation import Equation, Jaxpr, constants, equations
from ...internal.interpret import Interpreter, bind, run, value
from ...internal.moved import InternalMoved, warn_fallback
from ...internal.primitives import Kind
from ..plan import Plan
from .split import Bucket, Split


class Cut(NamedTuple):
    """One chunk of a leaf: ``size`` indices from ``start`` along ``axis`` (of the true shape;
    a stored leaf is padded along its shard dimension only, which is never ``axis``)."""

    axis: int
    start: int
    size: int

    def take(self, x: jax.Array) -> jax.Array:
        """The chunk of ``x`` (a static dynamic-slice: XLA streams it from host memory)."""
        return jax.lax.dynamic_slice_in_dim(x, self.start, self.size, self.axis)

    def put(self, buffer: jax.Array, x: jax.Array) -> jax.Array:
        """``buffer`` with the chunk ``x`` written in (into host memory where it rests)."""
        return jax.lax.dynamic_update_slice_in_dim(buffer, x, self.start, self.axis)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[: self.axis], self.size, *shape[self.axis + 1 :])


def cuts(split: Split, bucket: Bucket, plan: Plan, chunk: int | None) -> tuple[Cut, ...] | None:
    """:func:`_cuts`; None (the bucket whole, with a warning) where a JAX internal that
    chunking reads has moved."""
    try:
        return _cuts(split, bucket, plan, chunk)
    except InternalMoved as moved:
        state = [plan.opt[j] for j in bucket.opt]
        nbytes = sum(math.prod(s.layout.padded) * s.dtype.itemsize for s in state)
        warn_fallback(
            "the streamed offload's chunks",
            moved,
            "each parameter leaf's optimizer state is streamed through the device whole",
            f"up to {nbytes:,} bytes of one leaf's state on the device at once instead of "
            f"{chunk:,} elements' worth",
        )
        return None


def _cuts(split: Split, bucket: Bucket, plan: Plan, chunk: int | None) -> tuple[Cut, ...] | None:
    """The chunks ``bucket`` is evaluated in, or None to evaluate it whole.

    Whole: without a chunk size, a bucket of several parameters (the whole-tree fallback),
    a leaf of at most ``chunk`` elements, a bucket that is not elementwise, or a leaf whose
    every axis of size > 1 is sharded. Otherwise the cut axis is the most major free axis
    along which one index holds at most ``chunk`` elements (contiguous host copies); if
    none does, the free axis whose one index holds the fewest elements (the chunks, one
    index each, then exceed ``chunk``). The chunks are as even as their count allows.
    """
    if chunk is None or len(bucket.params) != 1:
        return None
    i = bucket.params[0]
    shape = plan.params[i].layout.shape
    size = math.prod(shape)
    layouts = [plan.params[i].layout, *(plan.opt[j].layout for j in bucket.opt)]
    layouts += [] if plan.master is None else [plan.master[i].layout]
    if size <= chunk or any(lay.shape != shape for lay in layouts):
        return None
    if not elementwise(split.jaxpr, bucket.equations, shape):
        return None
    entry = lambda spec, a: spec[a] if a < len(spec) else None
    free = [
        a
        for a in range(len(shape))
        if shape[a] > 1 and all(entry(lay.spec, a) is None for lay in layouts)
    ]
    if not free:
        return None
    fits = [a for a in free if size // shape[a] <= chunk]
    axis = min(fits) if fits else min(free, key=lambda a: size // shape[a])
    count = -(-shape[axis] // max(1, chunk // (size // shape[axis])))
    ends = [shape[axis] * c // count for c in range(count + 1)]
    return tuple(Cut(axis, a, b - a) for a, b in zip(ends, ends[1:]))


def elementwise(jaxpr: Jaxpr, eqns: Iterable[int], shape: tuple[int, ...]) -> bool:
    """Whether the given equations of ``jaxpr`` are elementwise over leaves of ``shape``."""
    all_eqns = equations(jaxpr)
    return all(_elementwise(all_eqns[e], shape) for e in eqns)


def _elementwise(eqn: Equation, shape: tuple[int, ...]) -> bool:
    if any(s not in ((), shape) for s in eqn.shapes):
        return False
    if eqn.kind is Kind.CALL:
        inner = eqn.call()
        consts = all(getattr(c, "shape", ()) in ((), shape) for c in constants(inner))
        return consts and all(_elementwise(e, shape) for e in equations(inner))
    if eqn.kind is Kind.BROADCAST:
        eqn.broadcast_to(lambda s: s)  # what a chunk reads of it (InternalMoved if moved)
        return eqn.broadcasts_scalar
    return eqn.kind is Kind.ELEMENTWISE


class _Scope(MutableMapping):
    """The values one chunk's equations see: those evaluated in the chunk (``local``), or
    whole ones from ``whole`` (a gradient, a global value), sliced to the chunk on first
    read unless they are scalars; a whole value with a ``chunk(cut)`` method computes its
    chunk itself."""

    def __init__(self, local: dict, whole: dict, cut: Cut):
        self.local, self.whole, self.cut = local, whole, cut

    def __getitem__(self, v: Any) -> Any:
        if v not in self.local:
            x = self.whole[v]
            if hasattr(x, "chunk"):  # a value that computes its own chunk
                self.local[v] = x.chunk(self.cut)
            else:
                self.local[v] = x if jax.numpy.ndim(x) == 0 else self.cut.take(x)
        return self.local[v]

    def __setitem__(self, v: Any, x: Any) -> None:
        self.local[v] = x

    def __delitem__(self, v: Any) -> None:
        del self.local[v]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.local)

    def __len__(self) -> int:
        return len(self.local)


class _Chunking(Interpreter):
    """Elementwise equations on one chunk: a ``jit`` inlined, so that its shapes become
    the chunk's; a ``broadcast_in_dim`` of a scalar to the chunk's shape."""

    def __init__(self, cut: Cut):
        self.cut = cut

    def scope(self, consts: dict) -> MutableMapping:
        return _Scope({}, consts, self.cut)

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any] | None:
        if eqn.kind is Kind.CALL:
            return run(eqn.call(), values, self)
        if eqn.kind is Kind.BROADCAST:
            return bind(eqn, values, eqn.broadcast_to(self.cut.shape))
        return None


def read(v: Any, env: dict, local: dict, cut: Cut) -> Any:
    """The chunk's value of a jaxpr atom: evaluated in the chunk (``local``), or whole in
    ``env`` (a gradient, a global value; sliced to the chunk unless it is a scalar)."""
    return value(_Scope(local, env, cut), v)


def evaluate(jaxpr: Jaxpr, eqns: Iterable[int], env: dict, local: dict, cut: Cut) -> None:
    """Evaluates elementwise equations of ``jaxpr`` on one chunk, writing ``local``."""
    interpret.evaluate(jaxpr, _Scope(local, env, cut), _Chunking(cut), eqns)
