"""Flax Linen adapter: a ``TrainState`` whose ``params`` collection is ZeRO-partitioned;
other collections (``batch_stats``, ...) ride along in ``ZeroState.model_state``, kept
identical on every device (floats averaged over 'data').

Examples:
    >>> state = jzero.linen.TrainState.create(
    ...     apply_fn=model.apply, variables=model.init(key, x), tx=optax.adam(1e-3),
    ...     mesh=jzero.data_mesh(), stage=3)
    >>> def loss_fn(params, model_state, batch):  # model_state: {'batch_stats': ...}
    ...     logits, updates = model.apply({'params': params, **model_state}, batch['x'],
    ...                                   train=True, mutable=['batch_stats'])
    ...     return cross_entropy(logits, batch['y']), updates
    >>> state, metrics = state.train_step(loss_fn)(state, batch)  # build the step once
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import struct
from jax.sharding import Mesh

from ..core.mesh import fit_specs
from ..core.options.step import StepOptions, step_options
from ..core.options.zero_config import ZeroConfig, zero_config
from ..core.plan import ZeroState
from ..optimizers.zero_optimizer import ZeroOptimizer
from .linen_layers import by_layer, layer_classes
from .shared import AdapterStep, adapter_optimizer, adapter_options
from .specs import linen_specs


@struct.dataclass
class TrainState:
    """Like ``flax.training.train_state.TrainState``, with the model states partitioned.

    ``zero``: the :class:`jzero.ZeroState` (params at rest, Optax state, other collections);
    ``apply_fn``: usually ``model.apply``; ``opt``: the :class:`jzero.ZeroOptimizer`."""

    zero: ZeroState
    apply_fn: Callable[..., Any] = struct.field(pytree_node=False)
    opt: ZeroOptimizer = struct.field(pytree_node=False)
    layers: tuple[type[nn.Module], ...] = struct.field(pytree_node=False, default=())

    step = property(lambda self: self.zero.step)
    model_state = property(lambda self: self.zero.model_state, doc="Other collections.")
    variables = property(lambda self: {"params": self.params, **self.model_state})

    @functools.cached_property
    def params(self) -> Any:
        """The full parameters (true shapes), gathered once per state and then kept."""
        return self.opt.full_params(self.zero)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        variables: Mapping[str, Any] | None = None,
        init_fn: Callable[[], Mapping[str, Any]] | None = None,
        layers: type[nn.Module] | tuple[type[nn.Module], ...] = (),
        config: ZeroConfig | None = None,
        **options: Any,
    ) -> TrainState:
        """Partitions ``variables['params']`` per stage; ``tx``, ``mesh``, and ``config``
        (a :class:`jzero.ZeroConfig`), or in its place the keyword options ``stage``,
        ``param_specs``, ``rules``, ``min_shard_size``, ``precision``, ``comm`` and
        ``offload``, as for :class:`jzero.ZeroOptimizer`.

        ``variables`` is ``model.init(...)``'s output; or ``init_fn`` returns it (e.g.
        ``functools.partial(model.init, key, x)``) and runs under ``jit`` with sharded
        outputs, so in stage 3 no device holds the whole model. ``param_specs`` (over the
        mesh's other axes) default to the ``nn.with_partitioning`` metadata.

        ``rules``: logical axis rules, ``(logical_name, mesh_axes)`` pairs as
        ``nn.logical_axis_rules`` takes them, for parameters annotated with
        ``nn.with_logical_partitioning``: their names are mapped by
        ``nn.logical_to_mesh_axes`` (a name with no rule is replicated), and jzero adds
        ``'data'`` as to explicit specs. A variable's own rules come first, then ``rules``,
        then the ``nn.logical_axis_rules(...)`` context active at this call; logical names
        with none of these raise ``ValueError``. With ``rules``, explicit ``param_specs``
        name logical axes too. See :mod:`jzero.adapters.specs`.

        ``layers``: a Linen Module class (or a tuple of them), e.g. ``layers=Block``, for
        per-layer gathering without editing the model (FSDP's wrapping policy). The steps
        then run ``loss_fn`` with ``manual_gather=True``: in stages 2/3 every instance of
        ``layers`` called (its ``__call__``) inside ``loss_fn`` runs through
        :func:`jzero.remat_layer`, gathering its own ``'params'`` at its call and again in
        backward (stage 3 holds about one layer's gathered parameters at a time), while
        every other parameter is gathered once up front. Stages 0/1 run the plain model.
        Such layers must use only their ``'params'`` (no other collections, no RNGs);
        ``loss_fn`` is traced once more, abstractly, to find them (``ValueError`` if it
        calls none). Anything but a Module class raises ``TypeError``.
        """
        layers = layer_classes(layers)
        if (variables is None) == (init_fn is None):
            raise ValueError("TrainState.create needs exactly one of variables= or init_fn=.")
        abstract = jax.eval_shape(init_fn) if variables is None else variables
        if not isinstance(abstract, Mapping) or "params" not in abstract:
            found = sorted(abstract) if isinstance(abstract, Mapping) else type(abstract).__name__
            raise ValueError(
                f"can't find the model's params: the variables hold no 'params' collection "
                f"(found {found}). Pass the whole output of model.init(...) (e.g. {{'params': "
                "..., 'batch_stats': ...}), not variables['params']."
            )
        config = zero_config(config, options, what="jzero.linen.TrainState.create")
        layout = config.layout
        specs = linen_specs(
            abstract["params"], param_specs=layout.param_specs, rules=layout.rules, mesh=mesh
        )
        specs = fit_specs(nn.unbox(abstract["params"]), specs, mesh)
        opt = adapter_optimizer(tx, mesh, config, specs)
        # opt.init copies model_state, so the donated step never deletes the caller's arrays.
        rest = lambda v: nn.unbox({k: c for k, c in v.items() if k != "params"})
        if variables is None:
            zero = opt.init(
                init_fn=lambda: nn.unbox(init_fn()["params"]),
                model_state=jax.jit(lambda: rest(init_fn()))(),
            )
        else:
            zero = opt.init(nn.unbox(variables["params"]), model_state=rest(variables))
        return cls(zero=zero, apply_fn=apply_fn, opt=opt, layers=layers)

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        options: StepOptions | None = None,
        **kwargs: Any,
    ) -> AdapterStep:
        """A ``step(state, batch) -> (state, metrics)``: forward, backward and update, jitted.

        ``loss_fn(params, batch) -> loss`` when the model has only ``params``; otherwise
        ``loss_fn(params, model_state, batch) -> (loss, updates)``: ``model_state`` is
        ``{'batch_stats': ...}``, ``updates`` what ``apply(..., mutable=[...])`` returns
        (collections it leaves out are kept). With ``has_aux`` the loss part is
        ``(loss, aux)``. Options as for ``ZeroOptimizer.train_step``; with ``create(...,
        layers=...)``, ``manual_gather`` is always on (see there).

        ``axis_name``: the model's name for the batch axis (``nn.BatchNorm(axis_name=
        'batch')``), mapped onto jzero's batch axes. ``per_device_rng``: typed PRNG keys in
        ``model_state`` (e.g. ``variables={**model.init(...), 'rngs': {'dropout': key}}``)
        reach ``loss_fn`` folded with the device's index, so each device draws its own
        dropout masks; return them unchanged and derive each step's key by folding in a
        counter kept beside them (the key comes back unfolded, the counter agreed).
        """
        with_state = bool(self.model_state)
        options = step_options(options, kwargs, default=self.opt.config.step)
        if self.layers:
            loss_fn, options = by_layer(loss_fn, self.layers), replace(options, manual_gather=True)

        def inner(params, model_state, batch):
            out, updates = loss_fn(params, model_state, batch)
            return out, {**model_state, **updates}

        core = self.opt.train_step(
            inner if with_state else loss_fn,
            adapter_options(options, with_model_state=with_state),
        )
        return AdapterStep(core)
