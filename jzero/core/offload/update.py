"""Optimizer offload: optimizer state and fp32 master weights rest in pinned host memory.

ZeRO-Offload's split (Ren et al. 2021), which moves the least: parameters, gradients and
the forward/backward stay on the device; the sharded optimizer state and master weights
live in host memory. Each step streams them through the device bucket by bucket: a
bucket's state is copied in, updated next to its (device) gradients, and copied back; only
the new parameters stay on the device. A bucket is one parameter leaf and its state,
after the update's global part (counters, a global gradient norm) has run, when the
Optax transformation splits that way (:func:`.split.split_update`); otherwise the whole
tree is one bucket (correct for any transformation, but then the device holds the whole
state while it updates).

A bucket whose update is elementwise and whose leaf has more than ``Offload.stream_chunk``
elements streams in chunks of the leaf (:mod:`.chunks`): each chunk's state is sliced from
host memory, updated, and written into a fresh host buffer (dynamic-slice from, and
dynamic-update-slice into, host memory: the patterns XLA's host offloader streams).
Bucket or chunk k's copies are tied (``optimization_barrier``) to what piece k-2 wrote
back and to the parameters it wrote into the new leaves, so at most two pieces' state is
on the device. Tied to the write-backs alone, XLA:GPU may fuse each piece's parameter step
into the leaf's assembly and run them all after the last piece, every piece's new state
then held on the device (``benchmarks/h200_streamed_peak.md``). XLA:CPU drops
optimization barriers and its memory analysis shows no saving from host memory: on CPU
this module is tested for placement and numerics, not memory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ...internal.equation import environment
from ...internal.interpret import value as read
from ..grad_average import averaged
from ..grad_reduction import Gradients
from ..leaf_layout import LeafLayout
from ..options.precision import Precision
from ..plan import Plan, Stored
from ..stored_form import store, to_device, to_host, view
from ..update_inputs import UpdateInputs, keep_if_finite
from . import chunks
from .chunks import Cut
from .split import Bucket, Split, evaluate, split_update

_IN_FLIGHT = 2  # buckets whose state may be on the device at once


def offloaded_update(step: UpdateInputs) -> tuple[Any, Any, Any]:
    """The Optax update with the state streamed through the device, piece by piece
    (:class:`UpdateInputs`): the stored Optax state and master weights rest in host memory
    (the state on the device when only the parameters are offloaded; the weights in host
    memory with ``Offload(params=True)``). A chunked piece reads its chunk of the reduced
    sums and averages that (:class:`_Averaged`), so the averaged leaf is not held whole
    beside them."""
    tx, precision, plan, grads, opt_state, weights, finite = step
    split = split_update(tx, plan)
    o, w = jax.tree.leaves(opt_state), jax.tree.leaves(weights)
    stream = _Stream(split, plan, precision, grads, functools.partial(keep_if_finite, finite))
    new_o = stream.global_part(o)
    sources = [*o, *w]  # stored leaf t: Optax-state leaves, then the weights
    pieces = [
        (b, cut)
        for b in split.buckets
        for cut in chunks.cuts(split, b, plan, plan.config.offload.stream_chunk) or (None,)
    ]
    for k, (b, cut) in enumerate(pieces):
        ins = stream.copy_in(k, pieces, [sources[t] for t in stream.reads(b)])
        stream.update(b, cut, ins)
    return stream.results(new_o)


class _Stream:
    """The pieces of one offloaded update, in order, and what they have written so far.

    ``held`` maps each stored leaf ``t`` (:attr:`Split.stored_ins`) to its new value (for a
    chunked leaf, its chunks written so far); ``written`` lists each piece's stored leaves;
    ``pending`` is the last piece's writes, put into ``held`` once the next piece's copies
    are tied to them; ``new_p`` is the new parameter leaves on the device."""

    def __init__(
        self, split: Split, plan: Plan, precision: Precision, grads: Gradients, keep: Any
    ) -> None:
        self.split, self.plan, self.precision = split, plan, precision
        self.grads, self.keep = grads, keep
        self.reduced = jax.tree.leaves(grads.reduced)  # a chunk averages its piece of these
        self.env: dict = {}  # the traced update's values, from global_part on
        self.stored = (*plan.opt, *(plan.master or plan.params))
        self.held: dict[int, jax.Array] = {}
        self.written: list[list[int]] = []
        self.pending: list = []
        self.new_p: list[Any] = [None] * len(plan.params)

    def here(self, x: jax.Array, t: int) -> jax.Array:
        s = self.stored[t]
        return view(to_device(self.plan, [x], [s]), [s])[0]

    def there(self, x: jax.Array, t: int) -> jax.Array:
        s = self.stored[t]
        return to_host(self.plan, store([x], [s]), [s])[0]

    def reads(self, b: Bucket) -> list[int]:
        """The stored leaves bucket ``b`` copies in: its state, then its weights."""
        return [*b.opt, *(len(self.plan.opt) + i for i in b.params)]

    def global_part(self, o: list) -> list:
        """Evaluates the update's global part on the device from the averaged gradients;
        the new Optax-state leaves it writes (the counters), None for the others."""
        split = self.split
        self.env = environment(split.jaxpr, jax.tree.leaves(self.grads.averaged))
        self.env |= {split.state_ins[j]: self.here(o[j], j) for j in split.shared}
        evaluate(split, split.first, self.env)
        new_o = [None] * len(o)
        for j in split.shared:
            new = self.keep(read(self.env, split.state_outs[j]), self.env[split.state_ins[j]])
            new_o[j] = self.there(new, j)
        return new_o

    def copy_in(self, k: int, pieces: list, ins: list) -> list:
        """Piece ``k`` 's inputs, copied in only once piece k-2 is back and its parameters
        are written (else XLA fuses each piece's parameter step into the assembly and runs
        them all last, every piece's new state held on the device until then); the last
        piece's writes are then put in place, one chain per buffer."""
        j = k - _IN_FLIGHT
        tied, params = (self.written[j], pieces[j][0].params) if j >= 0 else ([], [])
        if tied or params:
            ins, back, new = jax.lax.optimization_barrier(
                (ins, [self.held[t] for t in tied], [self.new_p[i] for i in params])
            )
            self.held.update(zip(tied, back))
            for i, x in zip(params, new):
                self.new_p[i] = x
        _apply(self.pending, self.held, self.stored, self.plan)
        return ins

    def update(self, b: Bucket, cut: Cut | None, ins: list) -> None:
        """Bucket ``b`` (whole, or ``cut`` 's chunk) evaluated on its copied-in ``ins``:
        its new state and master weights pending, its new parameters written."""
        split, plan, keep = self.split, self.plan, self.keep
        given = {
            split.stored_ins[t]: self.here(x if cut is None else cut.take(x), t)
            for t, x in zip(self.reads(b), ins)
        }
        whole = self.env
        if cut is not None:  # the gradient's chunk averaged from the reduced sums
            denominator = self.grads.denominator
            whole = self.env | {
                split.grad_ins[i]: _Averaged(self.reduced[i], denominator, plan.params[i].layout)
                for i in b.params
            }
        value = _run(split, b, whole, given, cut)
        self.pending = []
        for j in b.opt:
            new = keep(value(split.state_outs[j]), given[split.state_ins[j]])
            self.pending.append((j, cut, self.there(new, j)))
        for i in b.params:
            old = given[split.weight_ins[i]]
            new = keep(optax.apply_updates(old, value(split.update_outs[i])), old)
            cast = self.precision.cast(new)
            self.new_p[i] = _assemble(self.new_p[i], cast, cut, plan.params[i])
            if plan.master is not None:
                t = len(plan.opt) + i
                self.pending.append((t, cut, self.there(new, t)))
        self.written.append([t for t, _, _ in self.pending])

    def results(self, new_o: list) -> tuple[Any, Any, Any]:
        """The last writes put in place: ``(params, opt_state, master)``."""
        plan, m = self.plan, len(self.plan.opt)
        _apply(self.pending, self.held, self.stored, plan)
        new_o = [self.held.get(j, x) for j, x in enumerate(new_o)]
        master = None
        if plan.master is not None:
            master = [self.held[m + i] for i in range(len(plan.params))]
            master = jax.tree.unflatten(plan.params_def, master)
        return (
            jax.tree.unflatten(plan.params_def, self.new_p),
            jax.tree.unflatten(plan.opt_def, new_o),
            master,
        )


class _Averaged(NamedTuple):
    """A gradient leaf as a chunk reads it: the chunk of the reduced sums, averaged
    (elementwise, so equal to the chunk of the averaged leaf, bit for bit)."""

    reduced: jax.Array  # stored (padded) shard, reduce dtype
    denominator: jax.Array
    layout: LeafLayout

    def chunk(self, cut: Cut) -> jax.Array:
        return averaged(cut.take(self.reduced), self.denominator, self.layout)


def _run(split: Split, bucket: Bucket, env: dict, inputs: dict, cut: Cut | None) -> Any:
    """Evaluates ``bucket`` on ``inputs`` (whole, or ``cut`` 's chunk); returns the reader
    of its values."""
    if cut is None:
        env |= inputs
        evaluate(split, bucket.equations, env)
        return lambda v: read(env, v)
    chunks.evaluate(split.jaxpr, bucket.equations, env, inputs, cut)
    return lambda v: chunks.read(v, env, inputs, cut)


def _apply(writes: list, held: dict, stored: tuple[Stored, ...], plan: Plan) -> None:
    """Puts each written value (a whole stored leaf, or a chunk) into ``held``."""
    for t, cut, x in writes:
        if cut is None:
            held[t] = x
            continue
        if t not in held:  # a fresh buffer where the leaf rests, chunks written into it
            zeros = jnp.zeros(stored[t].shape, stored[t].dtype)
            held[t] = to_host(plan, [zeros], [stored[t]])[0]
        held[t] = cut.put(held[t], x)


def _assemble(params: jax.Array | None, x: jax.Array, cut: Cut | None, s: Stored) -> jax.Array:
    """The new parameter leaf on the device: whole, or its chunks written in."""
    if cut is None:
        return x
    if params is None:
        params = jnp.zeros(s.layout.shape, x.dtype)
    return cut.put(params, x)
