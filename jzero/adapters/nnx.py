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

Stage 3 holds about one layer's gathered parameters at a time with
``TrainState.create(model, ..., layers=Block)``: every instance of ``Block`` in the model
gathers its own Params at its call (rematerialised, again in backward), with no edit to the
model (see ``tests/adapters/test_nnx_layers_option.py``). By hand, with
``state.train_step(loss_fn, manual_gather=True)``, the model gathers each layer where it
uses it, through :func:`remat_module` (e.g. in the body of an ``nnx.scan``) and
:func:`gathered` (see ``tests/adapters/test_nnx_layers.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from ..core.mesh import fit_specs
from ..core.options.step import StepOptions, step_options
from ..core.options.zero_config import ZeroConfig, zero_config
from ..core.plan import ZeroState
from ..optimizers.zero_optimizer import ZeroOptimizer
from .nnx_layers import by_layer, check_layers, layer_classes
from .nnx_remat import gathered as gathered
from .nnx_remat import is_sharded, split
from .nnx_remat import remat_layer as remat_layer
from .nnx_remat import remat_module as remat_module
from .shared import AdapterStep, adapter_optimizer, adapter_options
from .specs import nnx_specs


@struct.dataclass
class TrainState:
    """An NNX model's ZeRO-partitioned training state.

    Attributes:
        zero: the :class:`jzero.ZeroState`; ``params`` and ``model_state`` are pure dicts
            (``nnx.to_pure_dict``) of the module's ``nnx.Param`` and other state.
        graphdef: the module's structure, from ``nnx.split`` (static).
        opt: the :class:`jzero.ZeroOptimizer` (static).
        params_def, rest_def: treedefs of the Param and other ``nnx.State`` (static).
        layers: the ``layers=`` classes gathered per layer (static; empty: none).
    """

    zero: ZeroState
    graphdef: Any = struct.field(pytree_node=False)
    opt: ZeroOptimizer = struct.field(pytree_node=False)
    params_def: Any = struct.field(pytree_node=False)
    rest_def: Any = struct.field(pytree_node=False)
    layers: tuple[type[nnx.Module], ...] = struct.field(pytree_node=False, default=())

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        *,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        layers: type[nnx.Module] | tuple[type[nnx.Module], ...] = (),
        config: ZeroConfig | None = None,
        **options: Any,
    ) -> TrainState:
        """Splits ``model`` and partitions its ``nnx.Param`` state per stage; ``tx``,
        ``mesh``, and ``config`` (a :class:`jzero.ZeroConfig`), or in its place the keyword
        options ``stage``, ``param_specs``, ``rules``, ``min_shard_size``, ``precision``,
        ``comm`` and ``offload``, as for :class:`jzero.ZeroOptimizer`.

        ``param_specs`` (over the mesh's other axes, shaped like ``nnx.to_pure_dict`` of the
        Params) default to the Params' ``nnx.with_partitioning`` metadata; stacked layers
        (``nnx.vmap``) need ``transform_metadata={nnx.PARTITION_NAME: None}`` so that their
        spec covers the stacked axis.

        ``rules``: logical axis rules, ``(logical_name, mesh_axes)`` pairs as
        ``nnx.logical_axis_rules`` takes them, for Params whose ``out_sharding`` names
        logical axes: ``nnx.get_partition_spec`` maps them under ``rules`` (in place of the
        ``nnx.logical_axis_rules`` context, which is read when ``rules`` is None), combined
        with a Param's own ``sharding_rules``. As in NNX, a name with no rule is kept, so it
        must be a mesh axis (else ``ValueError``). jzero adds ``'data'`` as to explicit
        specs. With ``rules``, explicit ``param_specs`` name logical axes too, mapped as
        :class:`jzero.ZeroOptimizer` maps them. See :mod:`jzero.adapters.specs`.

        ``layers``: an ``nnx.Module`` class (or a tuple of them), e.g. ``layers=Block``, for
        FSDP-style per-layer gathering with no edit to the model: in stages 2/3 every
        instance of them in ``model`` gathers its own Params when called (its
        ``__call__``), through :func:`remat_module` (again in backward), and every other
        Param is gathered once at the start of the step; stage 3 then holds about one
        layer's gathered Params at a time. ``train_step`` then always runs with
        ``manual_gather`` on. Layers are found in the module graph (their outermost
        instances; nested ones run inside their parent's call); they must not be held in
        tuples, and the loss may use their Params only by calling them. Raises TypeError for
        anything but Module classes, ValueError when ``model`` holds no instance of them.
        """
        config = zero_config(config, options, what="jzero.nnx.TrainState.create")
        layers = layer_classes(layers)
        if layers:
            check_layers(model, layers)
        graphdef, params, rest = split(model)
        pure = nnx.to_pure_dict(params)
        layout = config.layout
        specs = nnx_specs(params, param_specs=layout.param_specs, rules=layout.rules, mesh=mesh)
        opt = adapter_optimizer(tx, mesh, config, fit_specs(pure, specs, mesh))
        # opt.init copies model_state, so the donated step never deletes the model's arrays.
        # RNG keys stay typed keys: the step folds them per device (per_device_rng).
        zero = opt.init(pure, model_state=nnx.to_pure_dict(rest))
        return cls(
            zero,
            graphdef,
            opt,
            jax.tree.structure(params),
            jax.tree.structure(rest),
            layers,
        )

    def _merge(self, params: Any, model_state: Any) -> nnx.Module:
        leaves = jax.tree.leaves(params, is_leaf=is_sharded)
        params = jax.tree.unflatten(self.params_def, leaves)
        rest = jax.tree.unflatten(self.rest_def, jax.tree.leaves(model_state))
        return nnx.merge(self.graphdef, params, rest)

    def model(self) -> nnx.Module:
        """A fresh ``nnx.Module`` with the full trained parameters and current other state."""
        return self._merge(self.opt.full_params(self.zero), self.zero.model_state)

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        options: StepOptions | None = None,
        **kwargs: Any,
    ) -> AdapterStep:
        """A jitted ``step(state, batch) -> (state, metrics)``; ``loss_fn(model, batch) -> loss``
        (with ``has_aux``: ``(loss, aux)``, aux in ``metrics['aux']``).

        ``loss_fn`` gets the module merged from the (gathered) parameters and the other
        state; whatever it changes in that state (e.g. BatchNorm running statistics in
        ``train`` mode) is carried to the next step, averaged over 'data'.

        With ``manual_gather=True`` the module's sharded Params hold :class:`jzero.Sharded`
        handles in stages 2/3 and ``loss_fn`` gathers each submodule where it uses it:
        layers through :func:`remat_module` (stage 3 then holds about one layer's gathered
        parameters at a time), other submodules through :func:`gathered`. Both leave plain
        arrays as they are (stages 0/1, or the model outside jzero), so one ``loss_fn``
        serves every stage. With ``TrainState.create(..., layers=...)``, ``manual_gather``
        is always on and the gathering is done for ``loss_fn`` (see there); ``loss_fn``
        then calls the model as it is. ``grad_accum`` and ``donate`` as for
        ``ZeroOptimizer.train_step``.

        ``per_device_rng`` (default True): the module's RNG streams (``nnx.Rngs``, e.g. for
        ``nnx.Dropout``) draw independently on each device: every stream's key is folded
        with the device's index for the step, and comes back unfolded with its count
        advanced, the same on every device. False: every device draws the same numbers.
        ``axis_name``: the model's name for the batch axis (``nnx.BatchNorm(axis_name=
        'batch')``), mapped onto jzero's batch axes.
        """
        options = step_options(options, kwargs, default=self.opt.config.step)
        if self.layers:
            loss_fn, options = by_layer(loss_fn, self.layers), replace(options, manual_gather=True)

        def inner(params: Any, model_state: Any, batch: Any) -> tuple[Any, Any]:
            model = self._merge(params, model_state)
            out = loss_fn(model, batch)
            return out, nnx.to_pure_dict(split(model)[2])

        core = self.opt.train_step(inner, adapter_options(options, with_model_state=True))
        return AdapterStep(core)
