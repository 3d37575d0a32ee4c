"""Per-layer gathering for NNX models by class (``TrainState.create(model, ..., layers=Block)``).

FSDP2's wrapping policy without editing the model: in stages 2/3 every instance of the
named ``nnx.Module`` classes gathers its own Params at its call, through
:func:`jzero.nnx.remat_module` (again in backward), and every other Param is gathered once
up front. The mechanism is graph surgery on the module merged for each traced step (never
on the user's model): each layer instance is swapped, in its parent, for a thin wrapper
module whose ``__call__`` runs the original through ``remat_module``; the parents are
restored before the step reads the model's other state back. No monkeypatching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ..core.comm.gatherer import Sharded, gather
from .nnx_remat import remat_module
from .shared import layer_classes as _classes

_is_sharded = lambda x: isinstance(x, Sharded)


def layer_classes(layers: Any) -> tuple[type, ...]:
    """``layers=`` as a tuple of Module classes, or a TypeError."""
    return _classes(layers, nnx.Module, "an nnx.Module")


def check_layers(model: nnx.Module, classes: tuple[type[nnx.Module], ...]) -> None:
    """A ValueError unless ``model`` holds an instance of ``classes`` (other than itself)."""
    names = ", ".join(c.__name__ for c in classes)
    if isinstance(model, classes):
        raise ValueError(
            f"layers=: the model itself is an instance of {names}; name the classes of its layers."
        )
    if not any(isinstance(node, classes) for _, node in nnx.iter_graph(model)):
        raise ValueError(f"layers=: the model holds no instance of {names}.")


def _walk(model: nnx.Module, classes: tuple[type[nnx.Module], ...]) -> tuple[list, list]:
    """The Params reachable from ``model`` without passing through a layer, and the
    ``(parent, key, layer)`` sites of the outermost layers."""
    params: dict[int, nnx.Variable] = {}
    sites: list[tuple[Any, Any, nnx.Module]] = []
    seen: set[int] = set()

    def visit(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for key, child in nnx.graph.get_node_impl(node).node_dict(node).items():
            if isinstance(child, nnx.Param):
                params[id(child)] = child
            elif isinstance(child, classes):
                sites.append((node, key, child))
            elif nnx.graph.is_node(child):
                visit(child)

    visit(model)
    return list(params.values()), sites


def _set(parent: Any, key: Any, value: Any) -> None:
    if isinstance(parent, (list, dict, nnx.List)):
        parent[key] = value
    elif isinstance(parent, tuple):
        raise NotImplementedError(
            f"layers=: a {type(value).__name__} held in a tuple cannot be swapped for its "
            f"per-layer call; hold layers in a list, nnx.List or attribute."
        )
    else:
        nnx.graph.get_node_impl(parent).set_key(parent, key, value)


def _call_layer(layer: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """``layer(*args, **kwargs)`` through :func:`jzero.nnx.remat_module`; array leaves of
    the arguments are traced, the others (flags, ``None``) are closed over."""

    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def fn(module: nnx.Module, *arrays: Any) -> Any:
        full = list(leaves)
        for i, a in zip(dynamic, arrays):
            full[i] = a
        a, k = jax.tree.unflatten(treedef, full)
        return module(*a, **k)

    return remat_module(fn)(layer, *(leaves[i] for i in dynamic))


class _Layer(nnx.Module):
    """Stands in for ``layer`` in its parent during one traced step: calls it per layer."""

    def __init__(self, layer: nnx.Module):
        self.layer = layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call_layer(self.layer, args, kwargs)


def by_layer(
    loss_fn: Callable[..., Any], classes: tuple[type[nnx.Module], ...]
) -> Callable[..., Any]:
    """``loss_fn(model, batch)`` for ``manual_gather=True``: every instance of ``classes``
    gathers its Params at its call (rematerialised); all other Params are gathered up front.
    ``model`` is the step's own merged module: it is changed in place, then restored."""

    def loss(model: nnx.Module, *rest: Any) -> Any:
        state = nnx.state(model, nnx.Param)
        if not any(map(_is_sharded, jax.tree.leaves(state, is_leaf=_is_sharded))):
            return loss_fn(model, *rest)  # stages 0/1: the plain model
        params, sites = _walk(model, classes)
        for p in params:
            p.set_value(gather(p.get_value()))
        wrappers = {id(layer): _Layer(layer) for _, _, layer in sites}  # shared: one wrapper
        for parent, key, layer in sites:
            _set(parent, key, wrappers[id(layer)])
        try:
            return loss_fn(model, *rest)
        finally:
            for parent, key, layer in sites:
                _set(parent, key, layer)

    return loss
