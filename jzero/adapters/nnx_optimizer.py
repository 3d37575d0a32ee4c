"""``jzero.nnx.Optimizer``: ``nnx.Optimizer`` with its state ZeRO-partitioned, for the user's
own ``nnx.jit`` step.

It is ``nnx.Optimizer`` around :func:`jzero.shard_optimizer`: the same ``update(model,
grads)``, the same ``step`` and ``opt_state`` Variables (sharded along ``data``), so
``nnx.state(optimizer)`` saves and restores with Orbax as Flax's does. The Params' own
``nnx.with_partitioning`` specs over other mesh axes are kept, as
``jzero.nnx.TrainState.create`` keeps them. At stage 3 the constructor places the model's
Params sharded, in place (as FSDP2's ``fully_shard(model)`` does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.mesh import fit_specs
from ..core.options.layout import Layout
from ..core.options.zero_config import ZeroConfig, zero_config
from ..optimizers.user_step.placement import shard_params
from ..optimizers.user_step.transformation import shard_optimizer
from .specs import nnx_specs


def _with_model_specs(config: ZeroConfig, state: nnx.State, mesh: Mesh) -> ZeroConfig:
    """``config`` whose layout names each Param's spec (from its metadata, or the given
    ``param_specs`` / ``rules``), shaped like the Param state's arrays."""
    layout = config.layout
    pure = nnx.to_pure_dict(state)
    specs = nnx_specs(state, param_specs=layout.param_specs, rules=layout.rules, mesh=mesh)
    leaves = jax.tree.leaves(fit_specs(pure, specs, mesh))
    specs = jax.tree.unflatten(jax.tree.structure(nnx.as_pure(state)), leaves)
    layout = Layout(param_specs=specs, min_shard_size=layout.min_shard_size)
    return dataclasses.replace(config, layout=layout)


def _hijax(state: nnx.State) -> bool:
    """Whether ``state`` holds hijax Variables (``nnx.var_defaults(hijax=True)``): JAX
    values themselves, not pytrees of arrays."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return any(getattr(x, "hijax", False) for x in leaves)


def _arrays(state: nnx.State) -> nnx.State:
    """``state`` with hijax Variables read as their arrays (others are pytrees already)."""
    return nnx.as_pure(state) if _hijax(state) else state


class Optimizer(nnx.Optimizer):
    """A drop-in for ``nnx.Optimizer`` whose Optax state is partitioned over ``mesh``'s
    ``data`` axis (and, at stage 3, the model's Params too).

    Args:
        model: the ``nnx.Module``.
        tx: any Optax transformation.
        wrt: the Variables to optimize, as for ``nnx.Optimizer`` (e.g. ``nnx.Param``).
        mesh: a mesh with a ``'data'`` axis.
        config: a :class:`jzero.ZeroConfig`; or, in its place, ``stage`` and the options
            :func:`jzero.shard_optimizer` takes.
        graph: as for ``nnx.Optimizer``.

    Examples:
        >>> optimizer = jzero.nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param,
        ...                                 mesh=mesh, stage=3)
        >>> @nnx.jit
        ... def train_step(model, optimizer, batch):
        ...     grads = nnx.grad(loss_fn)(model, batch)
        ...     optimizer.update(model, grads)
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        *,
        wrt: Any,
        mesh: Mesh,
        config: ZeroConfig | None = None,
        graph: bool | None = None,
        **options: Any,
    ):
        config = zero_config(config, options, what="jzero.nnx.Optimizer")
        state = nnx.state(model, wrt)
        config = _with_model_specs(config, state, mesh)
        if config.stage == 3:
            nnx.update(model, shard_params(_arrays(state), mesh, layout=config.layout))
        sharded = shard_optimizer(tx, mesh, config=config)
        if _hijax(state):  # nnx.Optimizer inits on the Variables themselves
            init = lambda params: sharded.init(nnx.as_pure(params))
            super().__init__(model, sharded._replace(init=init), wrt=wrt, graph=graph)
        else:
            super().__init__(model, sharded, wrt=wrt, graph=graph)
        # The step count lives on the mesh too, as the jitted update returns it.
        self.step[...] = jax.device_put(self.step[...], NamedSharding(mesh, P()))


class ModelAndOptimizer(Optimizer):
    """A drop-in for ``nnx.ModelAndOptimizer`` (deprecated in Flax, kept while Flax keeps
    it): :class:`Optimizer` holding its ``model``, so ``update(grads)`` takes the gradients
    alone.

    Examples:
        >>> state = jzero.nnx.ModelAndOptimizer(model, optax.adam(1e-3), mesh=mesh, stage=2)
        >>> state.update(nnx.grad(loss_fn)(state.model))
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        mesh: Mesh,
        config: ZeroConfig | None = None,
        **options: Any,
    ):
        super().__init__(model, tx, wrt=wrt, mesh=mesh, config=config, **options)
        self.model = model

    def update(self, grads: Any, /, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().update(self.model, grads, **kwargs)
