"""Per-layer gathering for Linen models by class (``TrainState.create(..., layers=Block)``).

FSDP2's wrapping policy without editing the model: every instance of the named Module
classes gathers its own parameters at its call, through :func:`jzero.remat_layer` (again
in backward), and every other parameter is gathered once up front. The blocks are found
by tracing the loss once, abstractly, under ``nn.intercept_methods``; the real call is
intercepted the same way. No monkeypatching.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from ..core.comm.gatherer import Sharded, gather
from ..core.gather.remat import remat_layer
from .shared import layer_classes as _classes

_is_sharded = lambda x: isinstance(x, Sharded)


def layer_classes(layers: Any) -> tuple[type, ...]:
    """``layers=`` as a tuple of Module classes, or a TypeError."""
    return _classes(layers, nn.Module, "a flax.linen Module")


class _Inside(threading.local):
    depth = 0  # > 0 while a layer's own apply runs: its calls (and nested layers) pass through


_inside = _Inside()


def _call_layer(module: nn.Module, method: str, args: tuple, kwargs: dict) -> Any:
    """``module.method(*args, **kwargs)`` through :func:`jzero.remat_layer`: the module's
    ``'params'`` (``Sharded`` handles) are gathered inside, again in backward."""
    variables = module.variables
    others = sorted(c for c in variables if c != "params")
    if others:
        raise NotImplementedError(
            f"layers=: {type(module).__name__} {module.scope.path} holds collections "
            f"{others} besides 'params'; only params-only layers can be gathered per layer."
        )
    unbound = module.clone(parent=None, _deep_clone=True)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def fn(params, *arrays):
        full = list(leaves)
        for i, a in zip(dynamic, arrays):
            full[i] = a
        a, k = jax.tree.unflatten(treedef, full)
        _inside.depth += 1
        try:
            return unbound.apply({"params": params}, *a, method=method, **k)
        finally:
            _inside.depth -= 1

    return remat_layer(fn)(variables.get("params", {}), *(leaves[i] for i in dynamic))


def by_layer(loss_fn: Callable[..., Any], classes: tuple[type[nn.Module], ...]) -> Callable:
    """``loss_fn`` for ``manual_gather=True``: every instance of ``classes`` gathers its
    parameters at its call (rematerialised); all other parameters are gathered up front."""

    def loss(params, *rest):
        if not any(map(_is_sharded, jax.tree.leaves(params, is_leaf=_is_sharded))):
            return loss_fn(params, *rest)  # stages 0/1: the plain model
        # Which parameter subtrees belong to layers: trace the model once, abstractly.
        paths: set[tuple[str, ...]] = set()

        def record(next_fun, args, kwargs, context):
            if isinstance(context.module, classes) and context.method_name == "__call__":
                paths.add(tuple(context.module.scope.path))
            return next_fun(*args, **kwargs)

        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.layout.shape, x.value.dtype) if _is_sharded(x) else x,
            params,
            is_leaf=_is_sharded,
        )
        with nn.intercept_methods(record):  # a fresh function: eval_shape's cache can't skip it
            jax.eval_shape(lambda *a: loss_fn(*a), shapes, *rest)
        if not paths:
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(f"layers=: loss_fn calls no instance of {names}.")

        def keys(path):
            return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)

        in_layer = lambda path: any(keys(path)[: len(p)] == p for p in paths)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x if in_layer(path) else gather(x), params, is_leaf=_is_sharded
        )

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            if _inside.depth or context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            if not isinstance(module, classes):
                return next_fun(*args, **kwargs)
            return _call_layer(module, context.method_name, args, kwargs)

        with nn.intercept_methods(intercept):
            return loss_fn(params, *rest)

    return loss
