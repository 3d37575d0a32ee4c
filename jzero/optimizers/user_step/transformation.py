"""``jzero.shard_optimizer``: any Optax transformation, ZeRO-partitioned, for the user's own
``jax.jit`` step.

The state is laid out along ``data`` (:mod:`.layout`); ``update`` constrains the gradients
to that layout at stages 1-3, so the compiler reduce-scatters them instead of all-reducing,
runs the wrapped update on the shards, and hands back updates in the parameters' layout:
replicated at stages 1-2 (the compiler all-gathers them), sharded at stage 3. Unlike
``ZeroOptimizer``'s own step, the compiler places the collectives: per-layer gathering,
prefetch, buckets, offload and quantized collectives need jzero's step.

Both functions run as ``jit`` programs of their own (inlined into the caller's ``jit``), on
the mesh's ``Auto`` twin (:mod:`jzero.core.axis_types`), and return arrays typed with the
user's mesh, ``Explicit`` axes included.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from ...core.axis_types import compute_mesh, on_compute_mesh, typed
from ...core.gpu_target.compile_only import check_runnable
from ...core.input_checks import check_leaves
from ...core.options.zero_config import ZeroConfig, zero_config
from ...core.stacked_update import stacked
from ...internal.optax_private import is_params_placeholder
from ..zero_optimizer import ZeroOptimizer
from .layout import UserLayout, user_layout
from .manual_reshard import reshard
from .placement import check_placed, onto_mesh
from .user_options import check_user_step


class MasterWeightsState(NamedTuple):
    """:func:`shard_optimizer`'s state under a 16-bit :class:`jzero.Precision`."""

    inner_state: optax.OptState  # the wrapped transformation's state, of the fp32 master
    master: optax.Params  # fp32 copy of the parameters (others as they are), along 'data'


def shard_optimizer(
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    config: ZeroConfig | None = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its state (and gradients, and at stage 3 parameters) partitioned over
    ``mesh``'s ``data`` axis, for a training step the user writes with ``jax.jit``.

    Args:
        tx: any Optax transformation (chains, masks, schedules, ``inject_hyperparams``,
            ``MultiSteps``, Adafactor...).
        mesh: a mesh with a ``'data'`` axis, ``Auto`` or ``Explicit``.
        config: a :class:`jzero.ZeroConfig`; or, in its place, ``stage`` (0-3) and the
            options ``param_specs``, ``rules``, ``min_shard_size`` and ``precision``. A
            16-bit ``Precision(param_dtype=...)`` keeps fp32 master weights in the state
            (:class:`MasterWeightsState`). Communication, offload, dynamic loss scaling and
            step options need jzero's own step and are refused.

    Returns:
        An ``optax.GradientTransformationExtraArgs``. ``init(params)`` returns the wrapped
        state (a :class:`MasterWeightsState` with master weights) laid out along ``data``
        in true shapes: each leaf along the dimension ``ZeroOptimizer`` picks, where
        ``data``'s size divides it, else replicated. ``update(grads, state, params)``
        returns updates in the parameters' layout and the new state, equal to ``tx``'s
        up to the order in which the compiler sums the devices' gradients. At stage 3 the
        parameters rest sharded: place them with :func:`jzero.shard_params` first.

    Examples:
        >>> tx = jzero.shard_optimizer(optax.adamw(3e-4), mesh, stage=2)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... def step(params, opt_state, batch):
        ...     grads = jax.grad(loss_fn)(params, batch)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state
    """
    config = zero_config(config, options, what="jzero.shard_optimizer")
    check_user_step(config, what="jzero.shard_optimizer")
    sharded = _ShardedTransformation(tx, mesh, config)
    return optax.GradientTransformationExtraArgs(sharded.init, sharded.update)


class _ShardedTransformation:
    """``shard_optimizer``'s two functions, over one configuration and mesh."""

    def __init__(self, tx: optax.GradientTransformation, mesh: Mesh, config: ZeroConfig):
        self.tx, self.mesh, self.config = tx, mesh, config
        self.opt = ZeroOptimizer(tx, mesh, config=config)  # checks tx, the mesh, the layout
        self.twin, self.mixed = compute_mesh(mesh), config.precision.mixed
        self.layouts: dict[Any, UserLayout] = {}
        self.program = jax.jit(self._program, static_argnums=4)

    def layout(self, tree: Any) -> UserLayout:
        """The specs of a parameter (or gradient) tree like ``tree``, computed once."""
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        key = (jax.tree.structure(shapes), tuple(jax.tree.leaves(shapes)))
        if key not in self.layouts:
            self.layouts[key] = user_layout(self.opt.plan(shapes))
        return self.layouts[key]

    def _on_twin(self, tree: Any, specs: Any) -> Any:
        return _constrain(tree, specs, self.twin)

    def _shardings(self, specs: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

    def _state_specs(self, lay: UserLayout) -> Any:
        return MasterWeightsState(lay.state, lay.master) if self.mixed else lay.state

    def init(self, params: optax.Params) -> optax.OptState:
        if is_params_placeholder(params):  # optax.tree_map_params: Optax's own answer
            inner = self.tx.init(params)
            return MasterWeightsState(inner, params) if self.mixed else inner
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            check_runnable(self.mesh, "jzero.shard_optimizer(...).init")  # jax.eval_shape may
        check_leaves(params, "params", allow_empty=False)
        lay = self.layout(params)
        if self.config.stage == 3:
            check_placed(params, lay.params, self.mesh)

        def init(params):
            if not self.mixed:
                return self.tx.init(params)
            master = jax.tree.map(_fp32, params)
            return MasterWeightsState(self.tx.init(master), self._on_twin(master, lay.master))

        out = self._shardings(self._state_specs(lay))
        return jax.jit(on_compute_mesh(init, self.mesh), out_shardings=out)(params)

    def update(self, grads, state, params=None, **extra):
        check_update_args(grads, state, params, self.layout, mixed=self.mixed)
        grads, params = onto_mesh(grads, self.mesh), onto_mesh(params, self.mesh)
        arrays, passed = _split_extra(extra)
        return self.program(grads, state, params, arrays, passed)

    def _program(self, grads, state, params, arrays, passed):
        """The update, jitted (inlined into the caller's ``jit``), typed on the user's mesh."""
        extra = passed.join(arrays)
        updates, state = on_compute_mesh(self._update, self.mesh)(grads, state, params, extra)
        lay = self.layout(grads)
        updates = typed(updates, self._shardings(lay.params))
        return updates, typed(state, self._shardings(self._state_specs(lay)))

    def _update(self, grads, state, params, extra):
        """On the ``Auto`` twin: gradients and parameters onto the shards, the update there,
        the updates back in the parameters' layout."""
        lay, twin = self.layout(grads), self.twin
        # The compiler reduce-scatters the gradients onto the shards (stages 1-3; as they
        # are at stage 0): sliced from whole ones, they would be all-reduced first. A
        # mixing leaf's go straight to its owner layout (lay.update).
        grads = self._on_twin(grads, lay.update)
        shards = None if params is None else reshard(params, lay.params, lay.update, twin)
        if self.mixed:
            return self._master_update(grads, state, params, shards, extra)
        updates, state = self._tx_update(lay, extra)(grads, state, shards)
        updates = reshard(self._on_twin(updates, lay.update), lay.update, lay.params, twin)
        return updates, self._on_twin(state, lay.state)

    def _tx_update(self, lay: UserLayout, extra: dict[str, Any]) -> Any:
        """The wrapped update, with the plan's stacks of mixing leaves batched
        (:func:`jzero.core.stacked_update.stacked`; only without extra arguments)."""
        if extra:
            return lambda g, s, p: self.tx.update(g, s, p, **extra)
        return stacked(lay.plan, self.tx, jax.tree.leaves(lay.update))

    def _master_update(self, grads, state, params, shards, extra):
        """The update of the fp32 master; updates that move ``params`` to its rounding."""
        lay = self.layout(grads)
        inner, master = state
        steps, inner = self._tx_update(lay, extra)(jax.tree.map(_fp32, grads), inner, master)
        master = self._on_twin(optax.apply_updates(master, steps), lay.master)
        rounded = jax.tree.map(lambda m, p: m.astype(p.dtype), master, shards)
        rounded = reshard(self._on_twin(rounded, lay.update), lay.update, lay.params, self.twin)
        state = MasterWeightsState(self._on_twin(inner, lay.state), master)
        return jax.tree.map(_exact_step, rounded, params), state


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _key(x: Any) -> Any:
    """How a passed-through argument compares: Python scalars by value, the rest by identity."""
    return (type(x), x) if isinstance(x, bool | int | float | complex | str) else id(x)


def _split_extra(extra: dict[str, Any]) -> tuple[list[Any], _Passed]:
    """``update``'s extra arguments as the inner ``jit``'s array arguments and the rest
    (functions such as L-BFGS's ``value_fn``, strings, ...) passed through as they are."""
    leaves, treedef = jax.tree.flatten(extra)
    arrays = [x for x in leaves if _is_array(x)]
    others = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
    return arrays, _Passed(treedef, others)


class _Passed:
    """The extra arguments that are not arrays, static to the inner ``jit``: equal where
    they are the same objects, or equal Python scalars and strings (a function passed
    again does not retrace)."""

    def __init__(self, treedef: Any, others: tuple[tuple[int, Any], ...]):
        self.treedef, self.others = treedef, others

    def join(self, arrays: list[Any]) -> dict[str, Any]:
        leaves, arrays, others = [], iter(arrays), dict(self.others)
        for i in range(self.treedef.num_leaves):
            leaves.append(others[i] if i in others else next(arrays))
        return jax.tree.unflatten(self.treedef, leaves)

    def __hash__(self) -> int:
        return hash((self.treedef, tuple((i, _key(x)) for i, x in self.others)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Passed) or self.treedef != other.treedef:
            return False
        pairs = zip(self.others, other.others, strict=False)
        same = all(i == j and _key(x) == _key(y) for (i, x), (j, y) in pairs)
        return same and len(self.others) == len(other.others)


def _exact_step(new: jax.Array, old: jax.Array) -> jax.Array:
    """The update ``optax.apply_updates`` turns ``old`` into ``new`` with, bitwise: for
    16-bit floats their fp32 difference (exact; ``old + step`` rounds back to ``new``)."""
    if jnp.issubdtype(old.dtype, jnp.floating) and jnp.finfo(old.dtype).bits < 32:
        return new.astype(jnp.float32) - old.astype(jnp.float32)
    return new - old


def _fp32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _constrain(tree: Any, specs: Any, mesh: Mesh) -> Any:
    constrain = lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))
    return jax.tree.map(constrain, tree, specs)


def check_update_args(grads: Any, state: Any, params: Any, layout_of: Any, *, mixed: bool) -> None:
    """Raises where ``update``'s arguments cannot belong together: gradients whose tree or
    shapes differ from the parameters', or from those the state was made for."""
    check_leaves(grads, "grads", allow_empty=False)
    if params is None and mixed:
        raise ValueError(
            "jzero.shard_optimizer with a 16-bit Precision keeps fp32 master weights and "
            "returns the updates that take the parameters to them, so update needs the "
            "parameters: call tx.update(grads, opt_state, params)."
        )
    if params is not None:
        _same_shapes(grads, params)
    lay = layout_of(grads)
    inner = state.inner_state if mixed else state
    want, got = jax.tree.structure(lay.state), jax.tree.structure(inner)
    if want != got:
        raise ValueError(
            "the gradients' tree does not match the tree this optimizer state was made for "
            f"(the state of such gradients would be {want}, the state given is {got}); pass "
            "gradients of the same parameters that init received, e.g. "
            "jax.grad(loss_fn)(params) of those params, and the state init returned."
        )


def _same_shapes(grads: Any, params: Any) -> None:
    g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
    if g_def != p_def:
        raise ValueError(
            f"the gradients' tree {g_def} differs from the parameters' {p_def}; pass the "
            "gradients of exactly these parameters (jax.grad(loss_fn)(params))."
        )
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), p in zip(paths, jax.tree.leaves(params)):
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(
                f"gradient {jax.tree_util.keystr(path)} has shape {tuple(g.shape)} but its "
                f"parameter has {tuple(p.shape)}; pass the gradients of these parameters."
            )
