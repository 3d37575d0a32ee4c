"""Per-layer gathering for NNX modules by hand: ``gathered`` and ``remat_module``.

Shared by the NNX adapter (:mod:`.nnx`, which publishes them as ``jzero.nnx.gathered`` /
``jzero.nnx.remat_module``) and the by-class form (:mod:`.nnx_layers`).
``jzero.nnx.remat_layer`` is the old name of ``remat_module``: it warns and forwards (it
took a module where :func:`jzero.remat_layer` takes parameters).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from flax import nnx

from ..core.comm.gatherer import Sharded, gather
from ..core.gather.remat import remat_layer as _remat_layer


def split(model: nnx.Module) -> tuple[Any, Any, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def gathered(module: nnx.Module) -> nnx.Module:
    """``module`` with its ``nnx.Param`` values passed through :func:`jzero.gather`.

    For a loss given to ``TrainState.train_step(..., manual_gather=True)``, whose model
    holds :class:`jzero.Sharded` handles in its Params in stages 2/3: the result is a new
    module of the same structure whose Params hold full arrays and whose other variables
    (BatchNorm statistics, RNG state) are ``module``'s own, so updates to them are kept.
    Call it once per forward pass, where the module is used; for layers, prefer
    :func:`remat_module`, which also re-gathers in backward. On plain arrays and in stages
    0/1 the Params' values are returned unchanged.
    """
    graphdef, params, rest = split(module)
    return nnx.merge(graphdef, gather(params), rest)


def remat_module(
    fn: Callable[..., Any], *, policy: Callable[..., bool] | None = None
) -> Callable[..., Any]:
    """``layer(module, *args) = fn(gathered(module), *args)``, rematerialised.

    The NNX form of :func:`jzero.remat_layer`, for a function of a module rather than of
    parameters: call it on each layer of a model trained
    with ``TrainState.train_step(..., manual_gather=True)``, e.g. inside the body of an
    ``nnx.scan`` over layers stacked with ``nnx.vmap``. In stage 3 the layer's Params are
    all-gathered once its input exists and again in backward, so about one layer's gathered
    parameters are alive at a time; in stages 0-2 it is ``jax.checkpoint(...,
    policy=policy)``. Changes ``fn`` makes to the layer's other variables (BatchNorm
    statistics) are written back to ``module``; its Params must not be assigned.

    Args:
        fn: ``fn(module, *args)``; ``args`` are pytrees of arrays (no modules).
        policy: a ``jax.checkpoint_policies`` policy for stages 0-2.

    Examples:
        >>> block = jzero.nnx.remat_module(lambda layer, x: layer(x))
        >>> @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        ... def forward(layer, x):
        ...     return block(layer, x)
    """

    def pure(params: Any, graphdef: Any, rest: Any, *args: Any) -> tuple[Any, Any]:
        module = nnx.merge(graphdef, params, rest)
        out = fn(module, *args)
        return out, split(module)[2]

    def layer(module: nnx.Module, *args: Any) -> Any:
        graphdef, params, rest = split(module)
        static = _remat_layer(
            lambda params, rest, *args: pure(params, graphdef, rest, *args), policy=policy
        )
        out, rest = static(params, rest, *args)
        nnx.update(module, rest)
        return out

    return layer


def remat_layer(
    fn: Callable[..., Any], *, policy: Callable[..., bool] | None = None
) -> Callable[..., Any]:
    """Deprecated: :func:`remat_module` (the same function, renamed so that it is not
    mistaken for :func:`jzero.remat_layer`, which takes parameters, not a module)."""
    warnings.warn(
        "jzero.nnx.remat_layer is renamed jzero.nnx.remat_module (the same function; "
        "jzero.remat_layer is the one for parameters); call jzero.nnx.remat_module.",
        DeprecationWarning,
        stacklevel=2,
    )
    return remat_module(fn, policy=policy)
