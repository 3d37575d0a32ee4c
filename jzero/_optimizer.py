"""``ZeroOptimizer``: wraps an Optax transformation and places model states per ZeRO stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._layout import DEFAULT_MIN_SHARD_SIZE, LeafLayout, Plan, is_layout, leaf_layout, pad, unpad
from ._mesh import check_mesh, fit_specs
from ._precision import LossScale, Precision
from ._state import ZeroState

Stage = Literal[0, 1, 2, 3]


def _check_leaves(tree: Any, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            raise TypeError(
                f"{what} leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
                "array; jzero shards arrays only. Convert it with jnp.asarray(...) or keep it "
                "out of the parameter tree (e.g. as a static config)."
            )


def _shape_key(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


class ZeroOptimizer:
    """ZeRO stage 0-3 around any ``optax.GradientTransformation``.

    Args:
        tx: the Optax transformation, e.g. ``optax.adamw(3e-4)``.
        mesh: a mesh with a ``'data'`` axis (other axes are left to the user's specs).
        stage: 0 (plain data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
            3 (+ parameters).
        min_shard_size: leaves with fewer elements, and scalars, stay replicated (default 0:
            every non-scalar leaf is sharded).
        param_specs: optional pytree of ``PartitionSpec`` over the mesh's *other* axes, shaped
            like the parameters (a prefix is fine); jzero adds ``'data'`` to each.
        precision: a :class:`Precision` policy (default: everything float32).

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
        stage: Stage,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        param_specs: Any = None,
        precision: Precision | None = None,
    ):
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in get_args(Stage):
            raise ValueError(
                f"stage must be 0, 1, 2 or 3, got {stage!r}: 0 = plain data parallel, "
                "1 = shard optimizer state, 2 = + gradients, 3 = + parameters."
            )
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"tx must be an optax.GradientTransformation, got {type(tx).__name__}; "
                "e.g. optax.adamw(3e-4) or optax.chain(...)."
            )
        if min_shard_size < 0:
            raise ValueError(f"min_shard_size must be >= 0, got {min_shard_size}.")
        self.tx, self.mesh, self.stage = tx, mesh, stage
        self.data_size = check_mesh(mesh)
        self.min_shard_size = min_shard_size
        self.param_specs = param_specs
        self.precision = Precision() if precision is None else precision
        if not isinstance(self.precision, Precision):
            raise TypeError(f"precision must be a jzero.Precision, got {type(precision)}.")

    # ----------------------------------------------------------------------------- plan
    def plan(self, params: Any) -> Plan:
        """The per-leaf layout of ``params`` (arrays or ``jax.ShapeDtypeStruct``s).

        ``print(opt.plan(params).describe())`` shows, per leaf, its shard dimension, stored
        (padded) shape and ``PartitionSpec``.
        """
        _check_leaves(params, "params")
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        user = self._user_specs(shapes)
        n = 1 if self.stage == 0 else self.data_size
        rule = lambda x, spec: leaf_layout(
            x.shape, n, min_shard_size=self.min_shard_size, user_spec=spec
        )
        param_lays = jax.tree.map(rule, shapes, user)
        # Optimizer-state leaves take the user spec of the parameters of their shape.
        by_shape: dict[tuple[int, ...], set[P]] = {}
        for lay in jax.tree.leaves(param_lays, is_leaf=is_layout):
            by_shape.setdefault(lay.shape, set()).add(lay.user_spec)
        opt_shapes = jax.eval_shape(self.tx.init, shapes)
        _check_leaves(opt_shapes, "optimizer state")
        spec_of = lambda s: next(iter(by_shape[s])) if len(by_shape.get(s, ())) == 1 else P()
        opt_lays = jax.tree.map(lambda x: rule(x, spec_of(_shape_key(x.shape))), opt_shapes)
        p_leaves, p_def = jax.tree.flatten(param_lays, is_leaf=is_layout)
        o_leaves, o_def = jax.tree.flatten(opt_lays, is_leaf=is_layout)
        return Plan(self.stage, self.data_size, p_def, tuple(p_leaves), o_def, tuple(o_leaves))

    def _user_specs(self, shapes: Any) -> Any:
        if self.param_specs is None:
            return jax.tree.map(lambda _: P(), shapes)
        try:
            jax.tree.broadcast(self.param_specs, shapes, is_leaf=lambda x: isinstance(x, P))
        except ValueError as e:
            raise ValueError(
                f"param_specs does not match the parameter tree ({e}); give a PartitionSpec "
                "per parameter leaf, or a prefix of the tree."
            ) from None
        return fit_specs(shapes, self.param_specs, self.mesh, drop_data=False)

    # ------------------------------------------------------------------------ shardings
    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def param_sharding(self, lay: LeafLayout) -> NamedSharding:
        """Sharding of a parameter at rest: sharded in stage 3, replicated over data before."""
        return self._sharding(lay.spec if self.stage == 3 else lay.user_spec)

    def state_shardings(self, plan: Plan) -> ZeroState:
        """``NamedSharding``s of every leaf of a :class:`ZeroState` with ``plan``."""
        params = jax.tree.map(self.param_sharding, plan.params_tree(), is_leaf=is_layout)
        opt = jax.tree.map(lambda lay: self._sharding(lay.spec), plan.opt_tree(), is_leaf=is_layout)
        master = None
        if self.precision.mixed:
            sharded = lambda lay: self._sharding(lay.spec)
            master = jax.tree.map(sharded, plan.params_tree(), is_leaf=is_layout)
        loss_scale = None
        if self.precision.dynamic_loss_scale:
            loss_scale = LossScale(self._sharding(P()), self._sharding(P()))
        # model_state (replicated, any structure) is placed by init(), not listed here.
        return ZeroState(self._sharding(P()), params, opt, None, master, loss_scale, plan)

    def store_params(self, params: Any, plan: Plan) -> Any:
        """True-shaped params -> their at-rest form (padded in stage 3)."""
        if self.stage != 3:
            return params
        return jax.tree.map(pad, params, plan.params_tree())

    # ----------------------------------------------------------------------------- init
    def init(
        self,
        params: Any = None,
        *,
        init_fn: Callable[[], Any] | None = None,
        model_state: Any = None,
    ) -> ZeroState:
        """Places parameters and a fresh Optax state per stage.

        Args:
            params: the parameters (arrays), or their ``jax.ShapeDtypeStruct``s together
                with ``init_fn``.
            init_fn: a function of no arguments returning the parameters, e.g.
                ``functools.partial(model.init, key, x)``. It runs inside ``jit`` with the
                output already sharded, so in stage 3 no device ever holds the whole model.
            model_state: optional non-trainable state (e.g. Flax ``batch_stats``), kept
                replicated; see ``train_step(..., with_model_state=True)``.
        """
        if model_state is not None:
            _check_leaves(model_state, "model_state")
        fn, arg = self.init_program(params, init_fn=init_fn)
        state = fn(arg)
        # A copy (jit never aliases undonated inputs): the donated step must not delete
        # the caller's arrays.
        model_state = jax.jit(lambda x: x, out_shardings=self._sharding(P()))(model_state)
        return state.replace(model_state=model_state)

    def init_program(self, params: Any = None, *, init_fn: Callable[[], Any] | None = None):
        """The jitted program ``init`` runs, and its argument (for inspecting its memory)."""
        if init_fn is None:
            if params is None:
                raise ValueError("init() needs params, or init_fn= returning them.")
            _check_leaves(params, "params")
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
                raise ValueError(
                    "params holds jax.ShapeDtypeStruct leaves (abstract shapes) but no init_fn; "
                    "pass init_fn= to create the values, or pass concrete arrays."
                )
            abstract, make = params, lambda p: p
        else:
            abstract = jax.eval_shape(init_fn)
            if params is not None:
                _check_same_tree(params, abstract)
            make = lambda _: init_fn()
        plan = self.plan(abstract)
        opt_lays = plan.opt_tree()

        precision = self.precision

        def _init(p):
            p = precision.cast(make(p), jnp.float32) if precision.mixed else make(p)
            opt_state = jax.tree.map(pad, self.tx.init(p), opt_lays)
            step = jnp.zeros((), jnp.int32)
            params = self.store_params(precision.cast(p), plan)
            master = jax.tree.map(pad, p, plan.params_tree()) if precision.mixed else None
            scale = LossScale.create(precision) if precision.dynamic_loss_scale else None
            return ZeroState(step, params, opt_state, None, master, scale, plan)

        fn = jax.jit(_init, out_shardings=self.state_shardings(plan))
        return fn, (params if init_fn is None else None)

    # ----------------------------------------------------------------------- export
    def full_params(self, state: ZeroState) -> Any:
        """The whole model, true shapes, replicated over 'data' (e.g. for export)."""
        self.check_state(state)
        lays = state.plan.params_tree()
        out = jax.tree.map(lambda lay: self._sharding(lay.user_spec), lays, is_leaf=is_layout)
        return jax.jit(lambda p: jax.tree.map(unpad, p, lays), out_shardings=out)(state.params)

    def check_state(self, state: Any) -> None:
        """Raises if ``state`` was not made by an optimizer of this stage and mesh size."""
        if not isinstance(state, ZeroState):
            raise TypeError(f"expected a jzero.ZeroState from opt.init(...), got {type(state)}.")
        plan = state.plan
        if (plan.stage, plan.data_size) != (self.stage, self.data_size):
            raise ValueError(
                f"state was made for stage {plan.stage} on {plan.data_size} devices, but this "
                f"optimizer is stage {self.stage} on {self.data_size}; create the state with "
                "this optimizer's init()."
            )
        if (state.master is not None) != self.precision.mixed:
            raise ValueError(
                f"state was made with a different precision policy than this optimizer's "
                f"({self.precision}); create the state with this optimizer's init()."
            )
        if jax.tree.structure(state.params) != plan.params_def:
            raise ValueError(
                "state.params does not match the parameter tree given to init() "
                f"(got {jax.tree.structure(state.params)}, expected {plan.params_def}); "
                "re-run opt.init(params) after changing the model."
            )

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        *,
        manual_gather: bool = False,
        grad_accum: int = 1,
        with_model_state: bool = False,
        donate: bool = True,
    ):
        """A jitted ``step(state, batch) -> (state, metrics)``.

        See :func:`jzero._step.make_train_step` for the arguments: ``manual_gather`` (the
        loss gathers per layer, e.g. with :func:`jzero.remat_layer`), ``grad_accum``
        (micro-batches per step), ``with_model_state`` (``loss_fn(params, model_state,
        batch) -> (loss, model_state)``) and ``donate``.
        """
        from ._step import make_train_step

        return make_train_step(
            self,
            loss_fn,
            manual_gather=manual_gather,
            grad_accum=grad_accum,
            with_model_state=with_model_state,
            donate=donate,
        )


def _check_same_tree(given: Any, expected: Any) -> None:
    gd, ed = jax.tree.structure(given), jax.tree.structure(expected)
    if gd != ed:
        raise ValueError(
            f"params tree {gd} does not match the tree init_fn returns {ed}; pass matching "
            "shapes, or only init_fn=."
        )
    for (path, g), e in zip(
        jax.tree_util.tree_flatten_with_path(given)[0], jax.tree.leaves(expected)
    ):
        if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype:
            raise ValueError(
                f"params leaf {jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but "
                f"init_fn returns {e.dtype}{list(e.shape)}; make them agree."
            )
