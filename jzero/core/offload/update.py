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
on the device. (Tied to the write-backs alone, the H200's compiler fused each piece's
parameter step into the leaf's assembly and ran them all after the last piece: every
piece's new state stayed on the device, 9.66 of the 9.69 GB offloaded.) XLA:CPU drops
optimization barriers and its memory analysis shows no saving from host memory: on CPU
this module is tested for placement and numerics, not memory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ...internal.equation import environment, inputs, outputs
from ...internal.interpret import value as read
from ..grad_average import averaged
from ..leaf_layout import LeafLayout
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
    jin, jout = inputs(split.jaxpr), outputs(split.jaxpr)
    g, o, w = jax.tree.leaves(grads.averaged), jax.tree.leaves(opt_state), jax.tree.leaves(weights)
    reduced = jax.tree.leaves(grads.reduced)
    n, m = len(g), len(o)
    # Targets t: Optax-state leaves 0..m-1, then weights m..m+n-1 (jaxpr input n + t).
    stored, src = (*plan.opt, *(plan.master or plan.params)), [*o, *w]
    here = lambda x, s: view(to_device(plan, [x], [s]), [s])[0]
    there = lambda x, s: to_host(plan, store([x], [s]), [s])[0]
    keep = functools.partial(keep_if_finite, finite)
    env = environment(split.jaxpr, g)
    env |= {jin[n + j]: here(o[j], stored[j]) for j in split.shared}
    evaluate(split, split.first, env)
    new_o, new_p = [None] * m, [None] * n
    for j in split.shared:  # counters: written from the global part
        new_o[j] = there(keep(read(env, jout[n + j]), env[jin[n + j]]), stored[j])
    pieces = [
        (b, cut)
        for b in split.buckets
        for cut in chunks.cuts(split, b, plan, plan.config.offload.stream_chunk) or (None,)
    ]
    held: dict[int, jax.Array] = {}  # target -> its new stored value (chunks: so far)
    written, pending = [], []  # targets per piece; the last piece's writes, not yet applied
    for k, (b, cut) in enumerate(pieces):
        reads = [*b.opt, *(m + i for i in b.params)]
        ins = [src[t] for t in reads]
        j = k - _IN_FLIGHT  # the piece whose writes must be back before k copies in
        tied, params = (written[j], pieces[j][0].params) if j >= 0 else ([], [])
        if tied or params:
            # copy in once piece k-2 is back and its parameters are written (else XLA
            # fuses each piece's parameter step into the assembly and runs them all last,
            # every piece's new state held on the device until then)
            ins, back, new = jax.lax.optimization_barrier(
                (ins, [held[t] for t in tied], [new_p[i] for i in params])
            )
            held.update(zip(tied, back))
            for i, x in zip(params, new):
                new_p[i] = x
        _apply(pending, held, stored, plan)  # after the barrier: one chain per buffer
        given = {
            jin[n + t]: here(x if cut is None else cut.take(x), stored[t])
            for t, x in zip(reads, ins)
        }
        whole = env
        if cut is not None:  # the gradient's chunk averaged from the reduced sums
            whole = env | {
                jin[i]: _Averaged(reduced[i], grads.denominator, plan.params[i].layout)
                for i in b.params
            }
        value = _run(split, b, whole, given, cut)
        pending = []
        for j in b.opt:
            new = keep(value(jout[n + j]), given[jin[n + j]])
            pending.append((j, cut, there(new, stored[j])))
        for i in b.params:
            old = given[jin[n + m + i]]
            new = keep(optax.apply_updates(old, value(jout[i])), old)
            new_p[i] = _assemble(new_p[i], precision.cast(new), cut, plan.params[i])
            if plan.master is not None:
                pending.append((m + i, cut, there(new, stored[m + i])))
        written.append([t for t, _, _ in pending])
    _apply(pending, held, stored, plan)
    new_o = [held.get(j, x) for j, x in enumerate(new_o)]
    master = None
    if plan.master is not None:
        master = jax.tree.unflatten(plan.params_def, [held[m + i] for i in range(n)])
    return (
        jax.tree.unflatten(plan.params_def, new_p),
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
