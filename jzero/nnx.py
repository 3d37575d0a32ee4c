"""Flax NNX adapter: train an ``nnx.Module`` with ZeRO through ``nnx.split`` / ``nnx.merge``.

The module's ``nnx.Param`` state is partitioned by jzero; every other variable (BatchNorm
statistics, RNG counters, ...) rides along in ``ZeroState.model_state``, replicated and kept
identical on every device (floats averaged over 'data'). ``nnx.with_partitioning`` specs
over other mesh axes (e.g. ``'model'``) are kept; jzero adds ``'data'``.

Examples:
    >>> state = jzero.nnx.TrainState.create(model, tx=optax.adam(1e-3),
    ...                                     mesh=jzero.data_mesh(), stage=3)
    >>> def loss_fn(model, batch):
    ...     return jnp.mean((model(batch['x']) - batch['y']) ** 2)
    >>> train_step = state.train_step(loss_fn)
    >>> state, metrics = train_step(state, batch)
    >>> model = state.model()  # an nnx.Module with the trained parameters
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from ._mesh import fit_specs
from ._optimizer import Stage, ZeroOptimizer
from ._state import ZeroState


def _split(model: nnx.Module) -> tuple[Any, Any, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def _keys_out(tree: Any) -> Any:
    """Typed PRNG keys -> their uint32 data, so jzero can keep them in agreement."""
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def _keys_in(tree: Any, impls: tuple[Any, ...]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(
        [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, impls)
        ]
    )


@struct.dataclass
class TrainState:
    """An NNX model's ZeRO-partitioned training state.

    Attributes:
        zero: the :class:`jzero.ZeroState`; ``params`` and ``model_state`` are pure dicts
            (``nnx.to_pure_dict``) of the module's ``nnx.Param`` and other state.
        graphdef: the module's structure, from ``nnx.split`` (static).
        opt: the :class:`jzero.ZeroOptimizer` (static).
        params_def, rest_def: treedefs of the Param and other ``nnx.State`` (static).
        key_impls: per leaf of the other state, the PRNG impl of a key leaf, else None.
    """

    zero: ZeroState
    graphdef: Any = struct.field(pytree_node=False)
    opt: ZeroOptimizer = struct.field(pytree_node=False)
    params_def: Any = struct.field(pytree_node=False)
    rest_def: Any = struct.field(pytree_node=False)
    key_impls: tuple[Any, ...] = struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        *,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        stage: Stage,
        min_shard_size: int = 0,
    ) -> TrainState:
        """Splits ``model`` and partitions its ``nnx.Param`` state per stage.

        Partition specs come from the Params' ``nnx.with_partitioning`` metadata; stacked
        layers (``nnx.vmap``) need ``transform_metadata={nnx.PARTITION_NAME: None}`` so
        that their spec covers the stacked axis.
        """
        graphdef, params, rest = _split(model)
        pure = nnx.to_pure_dict(params)
        specs = fit_specs(pure, nnx.to_pure_dict(nnx.get_partition_spec(params)), mesh)
        opt = ZeroOptimizer(tx, mesh, stage=stage, param_specs=specs, min_shard_size=min_shard_size)
        impls = tuple(
            jax.random.key_impl(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None
            for x in jax.tree.leaves(rest)
        )
        # A copy: the step donates the state's buffers, which must not be the model's arrays.
        model_state = jax.tree.map(jnp.copy, _keys_out(nnx.to_pure_dict(rest)))
        zero = opt.init(pure, model_state=model_state)
        return cls(zero, graphdef, opt, jax.tree.structure(params), jax.tree.structure(rest), impls)

    def _merge(self, params: Any, model_state: Any) -> nnx.Module:
        params = jax.tree.unflatten(self.params_def, jax.tree.leaves(params))
        rest = jax.tree.unflatten(
            self.rest_def, jax.tree.leaves(_keys_in(model_state, self.key_impls))
        )
        return nnx.merge(self.graphdef, params, rest)

    def model(self) -> nnx.Module:
        """A fresh ``nnx.Module`` with the full trained parameters and current other state."""
        return self._merge(self.opt.full_params(self.zero), self.zero.model_state)

    def train_step(
        self, loss_fn: Callable[[nnx.Module, Any], jax.Array], *, grad_accum: int = 1
    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
        """A ``step(state, batch) -> (state, metrics)``; ``loss_fn(model, batch) -> loss``.

        ``loss_fn`` gets the module merged from the (gathered) parameters and the other
        state; whatever it changes in that state (e.g. BatchNorm running statistics in
        ``train`` mode) is carried to the next step, averaged over 'data'.
        """

        def inner(params: Any, model_state: Any, batch: Any) -> tuple[jax.Array, Any]:
            model = self._merge(params, model_state)
            loss = loss_fn(model, batch)
            return loss, _keys_out(nnx.to_pure_dict(_split(model)[2]))

        core = self.opt.train_step(inner, with_model_state=True, grad_accum=grad_accum)

        def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
            zero, metrics = core(state.zero, batch)
            return state.replace(zero=zero), metrics

        return step
