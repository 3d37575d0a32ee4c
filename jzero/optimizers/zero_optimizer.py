"""``ZeroOptimizer``: the front users hold -- a configuration, and four calls into the core.

It holds one :class:`jzero.ZeroConfig` (given, or gathered from its keyword arguments),
checks it against the mesh and asks the core for the :class:`Plan` of a parameter tree
(:func:`jzero.core.planning.plan_for`); init and export go to
:mod:`jzero.core.stored_form` with that plan, and ``train_step`` hands ``(loss_fn, config,
tx, mesh)`` to :func:`jzero.core.train_step.make_train_step`, whose step reads placement
from ``state.plan`` alone. Nothing in the core imports this class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.gpu_target.compile_only import check_offload_target, check_runnable
from ..core.input_checks import (
    check_leaves,
    check_same_on_every_process,
    check_same_tree,
    check_state,
)
from ..core.mesh import REPLICA
from ..core.options.step import StepOptions, step_options
from ..core.options.zero_config import ZeroConfig, zero_config
from ..core.plan import Plan, ZeroState
from ..core.planning import plan_for
from ..core.stored_form import full_params, full_state, init_program
from ..core.train_step import TrainStep, make_train_step
from ..internal.primitives import warn_missing_primitives


class ZeroOptimizer:
    """ZeRO stage 0-3 around any ``optax.GradientTransformation``.

    Args:
        tx: the Optax transformation, e.g. ``optax.adamw(3e-4)``.
        mesh: a mesh with a ``'data'`` axis (other axes are left to the user's specs). With
            a ``'replica'`` axis too (:func:`jzero.hybrid_mesh`) the sharding is
            hybrid (HSDP): model states are sharded within each ``'data'`` group and
            replicated across ``'replica'``; the batch is split over both, and gradients are
            reduced within the group, then their shards all-reduced across replicas. Axes
            may be ``Auto`` or ``Explicit`` (``jax.make_mesh``'s default; also under
            ``jax.set_mesh``): jzero computes on the mesh's ``Auto`` twin and returns arrays
            typed with this mesh (:mod:`jzero.core.axis_types`). It is always passed here: a
            mesh set with ``jax.set_mesh`` is not read in its place.
        config: the run's :class:`jzero.ZeroConfig` (stage, layout, precision,
            communication, offload, step options); or, in its place, the keyword options
            below, gathered into one (never both).
        stage: 0 (plain data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
            3 (+ parameters).
        min_shard_size: leaves with fewer elements, and scalars, stay replicated (default 0:
            every non-scalar leaf is sharded).
        param_specs: optional pytree of ``PartitionSpec`` over the mesh's *other* axes, shaped
            like the parameters (a prefix is fine); jzero adds ``'data'`` to each.
        rules: optional logical axis rules, ``(logical_name, mesh_axes)`` pairs as
            ``nn.logical_axis_rules`` takes them, e.g. ``(('embed', None), ('mlp',
            'model'))``. ``param_specs`` then name logical axes, mapped as Flax maps them
            (:mod:`jzero.core.param_specs`; a name with no rule is replicated); ``data`` and
            ``replica`` are dropped from the result (jzero places them). Without
            ``param_specs``, the parameters' own Flax metadata is mapped instead (as
            ``model.init`` returns them, boxed by ``nn.with_logical_partitioning`` /
            ``nn.with_partitioning``, or an ``nnx.State`` whose Variables carry
            ``out_sharding``; :mod:`jzero.core.param_specs`), a box's own rules first; parameters
            with no metadata are refused with a ``ValueError`` (the rules would do nothing).
            A ``with nn.logical_axis_rules(...)`` context is not read here.
        precision: a :class:`Precision` policy (default: everything float32).
        comm: a :class:`Communication`: quantized gathers and reduce-scatters, buckets,
            prefetch (default: exact, one collective per leaf, no prefetch). Checked here
            against ``stage`` (e.g. ``gather_quant`` needs stage 3).
        offload: a :class:`jzero.Offload`: what rests in pinned host memory and where the
            optimizer step runs (stages 1-3; the backend must offer the ``pinned_host``
            memory kind). ``"optimizer"`` is short for ``Offload(optimizer="stream")``: the
            sharded Optax state and fp32 master weights rest in host memory and stream
            through the device, which updates them. ``Offload(optimizer="host")`` runs the
            update on the host (:mod:`jzero.core.offload.host_step`). None (default):
            everything on the device.

    Examples:
        >>> opt = jzero.ZeroOptimizer(optax.adamw(3e-4), jzero.data_mesh(), stage=3)
        >>> state = opt.init(params)
        >>> train_step = opt.train_step(loss_fn)
        >>> state, metrics = train_step(state, batch)
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        config: ZeroConfig | None = None,
        **options: Any,
    ):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"tx must be an optax.GradientTransformation, got {type(tx).__name__}; "
                "e.g. optax.adamw(3e-4) or optax.chain(...)."
            )
        self.tx, self.mesh = tx, mesh
        self.config = zero_config(config, options, what="ZeroOptimizer")
        check_offload_target(mesh, self.config.offload)
        self.data_size = self.config.check(mesh)
        self.replica_size = dict(mesh.shape).get(REPLICA, 1)
        warn_missing_primitives()

    stage = property(lambda self: self.config.stage, doc="The ZeRO stage (``config.stage``).")
    precision = property(lambda self: self.config.precision, doc="``config.precision``.")
    comm = property(lambda self: self.config.comm, doc="``config.comm``.")
    offload = property(lambda self: self.config.offload, doc="``config.offload``.")
    param_specs = property(lambda self: self.config.layout.param_specs)
    rules = property(lambda self: self.config.layout.rules)
    min_shard_size = property(lambda self: self.config.layout.min_shard_size)

    def plan(self, params: Any) -> Plan:
        """Where every leaf lives, for ``params`` (arrays or ``jax.ShapeDtypeStruct`` s).

        ``print(opt.plan(params).describe())`` shows, per leaf, its shard dimension, stored
        (padded) shape and ``PartitionSpec``.
        """
        return plan_for(self.tx, self.mesh, self.config, params)

    def init(
        self,
        params: Any = None,
        *,
        init_fn: Callable[[], Any] | None = None,
        model_state: Any = None,
    ) -> ZeroState:
        """Places parameters and a fresh Optax state per stage.

        Args:
            params: the parameters (arrays), or their ``jax.ShapeDtypeStruct`` s together
                with ``init_fn``.
            init_fn: a function of no arguments returning the parameters, e.g.
                ``functools.partial(model.init, key, x)``. It runs inside ``jit`` with the
                output already sharded, so in stage 3 no device ever holds the whole model.
            model_state: optional non-trainable state (e.g. Flax ``batch_stats``), kept
                replicated; see ``train_step(..., with_model_state=True)``.
        """
        check_runnable(self.mesh, "ZeroOptimizer.init")
        if model_state is not None:
            check_leaves(model_state, "model_state")
        fn, arg = self.init_program(params, init_fn=init_fn)
        state = fn(arg)
        # A copy (jit never aliases undonated inputs): the donated step must not delete
        # the caller's arrays.
        replicated = state.plan.sharding(P())
        model_state = jax.jit(lambda x: x, out_shardings=replicated)(model_state)
        return state.replace(model_state=model_state)

    def init_program(
        self, params: Any = None, *, init_fn: Callable[[], Any] | None = None
    ) -> tuple[Callable[[Any], ZeroState], Any]:
        """The jitted program ``init`` runs, and its argument (for inspecting its memory)."""
        if init_fn is None:
            if params is None:
                raise ValueError("init() needs params, or init_fn= returning them.")
            check_leaves(params, "params", allow_empty=False)
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
                raise ValueError(
                    "params holds jax.ShapeDtypeStruct leaves (abstract shapes) but no init_fn; "
                    "pass init_fn= to create the values, or pass concrete arrays."
                )
            check_same_on_every_process(params, "params")
            abstract, make, arg = params, lambda p: p, params
        else:
            abstract = jax.eval_shape(init_fn)
            if params is not None:
                check_same_tree(params, abstract)
            make, arg = (lambda _: init_fn()), None
        plan = self.plan(abstract)
        return init_program(self.tx, plan, self.precision, make), arg

    def full_params(self, state: ZeroState) -> Any:
        """The whole model, true shapes, replicated over 'data' (e.g. for export)."""
        check_runnable(self.mesh, "ZeroOptimizer.full_params")
        self.check_state(state)
        return full_params(state)

    def full_state(self, state: ZeroState) -> ZeroState:
        """``state`` with parameters, Optax state and fp32 master weights at their true
        shapes, replicated over 'data': what single-device Optax would hold."""
        check_runnable(self.mesh, "ZeroOptimizer.full_state")
        self.check_state(state)
        return full_state(state)

    def check_state(self, state: Any, *, tx: bool = False) -> None:
        """Raises if ``state`` was not made by an optimizer like this one (with ``tx``: of
        this Optax transformation too)."""
        check_state(state, self.config, mesh=self.mesh, tx=self.tx if tx else None)

    def train_step(
        self, loss_fn: Callable[..., Any], options: StepOptions | None = None, **kwargs: Any
    ) -> TrainStep:
        """A jitted ``step(state, batch) -> (state, metrics)``.

        ``options`` is a :class:`jzero.StepOptions` (how the loss is called: ``has_aux``,
        ``with_model_state``, ``grad_accum``, ``manual_gather``, ``donate``,
        ``per_device_rng``, ``axis_name``, ``remat_policy``); without it, the
        configuration's ``step``, with fields replaced by keyword arguments
        (``train_step(loss_fn, has_aux=True)``); not both. ``loss_fn`` may return a
        :class:`jzero.Weighted` ``(total, count)`` for a loss averaged over the global
        batch's tokens. A state consumed by an earlier donated step is refused with an
        error, not reused. See :func:`jzero.core.train_step.make_train_step`.
        """
        step = step_options(options, kwargs, default=self.config.step)
        return make_train_step(loss_fn, self.config.with_step(step), tx=self.tx, mesh=self.mesh)
