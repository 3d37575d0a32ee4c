"""A stage-3 layer loop that prefetches: FSDP2's forward and backward prefetch.

``prefetched_scan`` runs a scan over stacked layers whose parameters are sharded
(:class:`Sharded` stacks) as a ``custom_vjp`` with two loops of its own:

- forward: layer i+1's all-gather is issued in the loop step that computes layer i (the
  gathered layer rides in the loop carry), so on GPU the latency-hiding scheduler can
  overlap it with layer i's compute; each step takes its layer's VJP (``jax.vjp``) and
  stores its residuals, less those that are the layer's own arguments (the gathered
  parameters, the loop constants, its slice of ``xs``);
- backward, in reverse: layer i-1's all-gather is issued in the step that runs layer i's
  VJP from its stored residuals, with layer i's parameters (gathered one step earlier) put
  back in their place; the weight cotangent is reduce-scattered (cast to the reduce dtype)
  in that step.

What the residuals hold is ``policy``'s choice (:attr:`jzero.StepOptions.remat_policy`):
None keeps every activation, as FSDP does, and backward recomputes nothing (compiled dot
FLOPs those of the default step without prefetch); a ``jax.checkpoint_policies`` policy
keeps what it saves (``nothing_saveable``: the layer's input only) and backward recomputes
the rest, as :func:`jzero.remat_layer` does. Two layers' gathered parameters are alive at a
time instead of one (the estimator's ``prefetch=True`` term). Values are those of the plain
scan: the same gathers, the same layer function, the same reductions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ..comm.collectives import after, on_device, saves_no_gathered
from ..comm.gatherer import Gatherer, Sharded, no_copies
from ..comm.reducer import Reducer

Step = Callable[[Any, Any, list, Any], tuple[Any, Any]]
"""``step(consts, carry, params, x) -> (carry, y)``: one layer, ``params`` gathered."""


def prefetched_scan(
    step: Step,
    consts: Any,
    init: Any,
    handles: list[Sharded],
    xs: Any,
    *,
    length: int,
    reverse: bool,
    policy: Callable | None = None,
) -> tuple[Any, Any]:
    """``lax.scan`` of ``step`` over ``length`` layers, each layer's slice of ``handles``
    (stacked along their leading axis) gathered one step ahead, forward and backward.

    ``consts``, ``init`` and ``xs`` must hold floating-point arrays only (see
    :func:`can_prefetch`). Returns ``(carry, ys)`` as ``lax.scan`` would.
    """
    layouts = tuple(h.layout for h in handles)
    no_copies(handles, "a prefetched scan")
    how = (handles[0].gatherer, handles[0].reducer)  # the step's, the same for every handle
    return _layers(
        step,
        layouts,
        how,
        length,
        reverse,
        policy,
        consts,
        init,
        [h.sink for h in handles],
        [h.value for h in handles],
        xs,
    )


def can_prefetch(*trees: Any) -> bool:
    """Whether every leaf is a floating-point array (the loop's VJP then needs no float0)."""
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(trees))


def _at(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _gather(values: list, layouts: tuple, how: tuple, i: Any, dep: Any = None) -> list:
    """Layer ``i``'s parameters gathered by ``how``'s :class:`Gatherer`."""
    gatherer, _ = how
    # Offloaded stacks rest in host memory: the layer's shards are copied in here, per
    # step, in forward and again in backward.
    shards = [on_device(jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=False)) for v in values]
    if dep is not None:
        shards = after(shards, dep)
    return gatherer.all_gather(shards, layouts)


def _scatter(grads: list, layouts: tuple, how: tuple[Gatherer, Reducer]) -> list:
    gatherer, reducer = how
    return reducer.scatter(grads, layouts, flat=gatherer.bucket)


def _stack_last(looped: Any, last: Any, flip: bool) -> Any:
    """Loop outputs (processing order) and the peeled last step's -> position order."""

    def join(a, b):
        out = b[None] if a is None else jnp.concatenate([a, b[None]])
        return jnp.flip(out, 0) if flip else out

    if looped is None:
        return jax.tree.map(lambda b: join(None, b), last)
    return jax.tree.map(join, looped, last)


def _loop(length: int, reverse: bool, fetch: Callable, run: Callable, carry: Any):
    """Processes layers in order (``reverse``: from the last), each step fetching the next
    layer's parameters before running this one; the last step is peeled off so that no
    step fetches a layer it will not use. Returns (carry, outputs in position order)."""
    pos = lambda k: length - 1 - k if reverse else k
    # The first layer's gather waits for the loop's input (forward: the carry; backward:
    # its cotangent), or XLA may issue it early and hold it through the other pass.
    params = fetch(pos(0), dep=carry)

    def body(state, k):
        carry, params = state
        upcoming = fetch(pos(k + 1))  # issued before this layer's compute
        carry, out = run(carry, params, pos(k))
        return (carry, upcoming), out

    looped = None
    if length > 1:
        (carry, params), looped = jax.lax.scan(body, (carry, params), jnp.arange(length - 1))
    carry, last = run(carry, params, pos(length - 1))
    return carry, _stack_last(looped, last, flip=reverse)


def _differentiable(step: Step, policy: Callable | None) -> Step:
    """``step`` as forward differentiates it: as written (``policy=None``: its VJP keeps
    every activation), or checkpointed with ``policy`` (never a gathered parameter)."""
    if policy is None:
        return step
    return jax.checkpoint(step, policy=saves_no_gathered(policy))


@jax.tree_util.register_static
class _Residuals:
    """Where a layer VJP's residuals come from, recorded while forward traces it.

    A residual that *is* one of the layer's arguments (``consts``, the gathered parameters,
    its slice of ``xs``) is not stored: backward puts the argument back in its place (the
    parameters gathered again, one layer ahead). Every other residual (the activations the
    policy keeps, the layer's input) is stacked over layers by the forward loop.
    """

    def __init__(self):
        self.treedef = None
        self.sources: tuple = ()  # per VJP leaf: (argument index, leaf index) or None

    def split(self, vjp: Any, args: tuple) -> list:
        """The residuals to store; records where the others come from."""
        leaves, self.treedef = jax.tree.flatten(vjp)
        args = [jax.tree.leaves(a) for a in args]
        self.sources = tuple(_source(leaf, args) for leaf in leaves)
        return [leaf for leaf, src in zip(leaves, self.sources) if src is None]

    def join(self, stored: list, args: tuple) -> Any:
        """The layer's VJP from its stored residuals and ``args`` (as given to ``split``)."""
        args, stored = [jax.tree.leaves(a) for a in args], iter(stored)
        leaves = [next(stored) if s is None else args[s[0]][s[1]] for s in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)


def _source(leaf: Any, args: list[list]) -> tuple[int, int] | None:
    for a, arg in enumerate(args):
        for j, x in enumerate(arg):
            if leaf is x:
                return a, j
    return None


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _layers(step, layouts, how, length, reverse, policy, consts, init, sinks, values, xs):
    args = (consts, init, sinks, values, xs)
    return _layers_fwd(step, layouts, how, length, reverse, policy, *args)[0]


def _layers_fwd(step, layouts, how, length, reverse, policy, consts, init, sinks, values, xs):
    layer, residuals = _differentiable(step, policy), _Residuals()

    def run(carry, params, i):
        (new, y), vjp = jax.vjp(layer, consts, carry, params, _at(xs, i))
        return new, (y, residuals.split(vjp, (consts, params, _at(xs, i))))

    fetch = partial(_gather, values, layouts, how)
    carry, (ys, stored) = _loop(length, reverse, fetch, run, init)
    return (carry, ys), (consts, stored, values, xs, residuals)


def _layers_bwd(step, layouts, how, length, reverse, policy, res, cts):
    consts, stored, values, xs, residuals = res
    ct_carry, ct_ys = cts

    def run(state, params, i):
        ct_c, ct_consts = state
        vjp = residuals.join(_at(stored, i), (consts, params, _at(xs, i)))
        d_consts, d_carry, d_params, d_x = vjp((ct_c, _at(ct_ys, i)))
        ct_consts = jax.tree.map(jnp.add, ct_consts, d_consts)
        return (d_carry, ct_consts), (_scatter(d_params, layouts, how), d_x)

    fetch = partial(_gather, values, layouts, how)
    zeros = jax.tree.map(jnp.zeros_like, consts)
    (ct_init, ct_consts), (grads, ct_xs) = _loop(length, not reverse, fetch, run, (ct_carry, zeros))
    return ct_consts, ct_init, grads, [None] * len(values), ct_xs


_layers.defvjp(_layers_fwd, _layers_bwd)
