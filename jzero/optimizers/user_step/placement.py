"""``jzero.shard_params``: parameters at rest along ``data``, as stage 3 of
:func:`jzero.shard_optimizer` keeps them (true shapes, :mod:`.layout`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.gpu_target.compile_only import check_runnable
from ...core.input_checks import article, check_leaves
from ...core.options.layout import Layout
from ...core.options.zero_config import ZeroConfig
from ...core.planning import plan_for
from .layout import user_layout


def resting_specs(params: Any, mesh: Mesh, layout: Layout | None, stage: int = 3) -> Any:
    """The tree of ``PartitionSpec`` s ``stage`` keeps ``params`` in (along ``data`` at
    stage 3; over the user's other axes only, replicated over ``data``, at stages 0-2).
    Computed once per tree of shapes, mesh, layout and stage (an eager loop that places
    its parameters each step plans once)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    leaves, treedef = jax.tree.flatten(shapes)
    try:
        return _cached_specs(
            treedef, tuple((x.shape, x.dtype) for x in leaves), mesh, layout, stage
        )
    except TypeError:  # a layout of unhashable specs (e.g. a dict): planned each time
        return _plan_specs(shapes, mesh, layout, stage)


@functools.lru_cache(maxsize=64)
def _cached_specs(treedef, leaves: tuple, mesh: Mesh, layout: Layout | None, stage: int) -> Any:
    shapes = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in leaves])
    return _plan_specs(shapes, mesh, layout, stage)


def _plan_specs(shapes: Any, mesh: Mesh, layout: Layout | None, stage: int) -> Any:
    config = ZeroConfig(stage=stage, layout=layout or Layout())
    config.check(mesh)
    return user_layout(plan_for(optax.identity(), mesh, config, shapes)).params


def shard_params(params: Any, mesh: Mesh, *, layout: Layout | None = None, stage: int = 3) -> Any:
    """``params`` laid out on ``mesh`` as ZeRO ``stage`` keeps them: along ``data`` at
    stage 3, replicated over ``data`` at stages 0-2.

    At stage 3 each leaf is sharded along the dimension ``jzero.ZeroOptimizer`` would pick,
    where the ``data`` axis's size divides it (true shapes: no padding); other leaves, and
    scalars, stay replicated over ``data``. At stages 0-2 this places parameters created
    on one device where the first update returns them, so the user's ``jit`` step compiles
    once, not again at the second step. ``layout`` (a :class:`jzero.Layout`:
    ``param_specs`` over the mesh's other axes, ``rules``, ``min_shard_size``) must be the
    one given to :func:`jzero.shard_optimizer`. Inside ``jit`` this constrains the layout;
    outside it moves the arrays (the caller's unsharded copies stay alive while referenced).
    ``jax.ShapeDtypeStruct`` s come back as ``ShapeDtypeStruct`` s carrying the shardings
    (nothing runs; a compile-only :func:`jzero.gpu_mesh` is fine), to lower a step with.

    Examples:
        >>> params = jzero.shard_params(params, mesh)  # stage 3
        >>> tx = jzero.shard_optimizer(optax.adamw(3e-4), mesh, stage=3)
        >>> opt_state = tx.init(params)
        >>> params = jzero.shard_params(params, mesh, stage=2)  # replicated: one compile
    """
    if _abstract(params):
        specs = resting_specs(params, mesh, layout, stage)
        at = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
        return jax.tree.map(at, params, specs)
    check_runnable(mesh, "jzero.shard_params")
    check_leaves(params, "params", allow_empty=False)
    specs = resting_specs(params, mesh, layout, stage)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def _abstract(params: Any) -> bool:
    """True for a tree of ``jax.ShapeDtypeStruct`` s; raises for one that mixes them with
    arrays (neither placed nor only described)."""
    flags = [isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)]
    if any(flags) and not all(flags):
        raise ValueError(
            "jzero.shard_params got jax.ShapeDtypeStructs mixed with arrays; pass only "
            "shapes (they come back with their shardings, nothing placed) or only arrays "
            "(they are placed)."
        )
    return bool(flags) and all(flags)


def check_placed(params: Any, specs: Any, mesh: Mesh) -> None:
    """Raises where a concrete leaf of ``params`` does not rest as ``specs`` say (stage 3:
    the parameters must be placed with :func:`shard_params` before ``init``)."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), spec in zip(paths, jax.tree.leaves(specs)):
        if isinstance(x, jax.core.Tracer):
            continue
        want = NamedSharding(mesh, spec)
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(want, x.ndim):
            continue
        raise ValueError(
            f"stage 3 keeps the parameters sharded along 'data', but params"
            f"{jax.tree_util.keystr(path)} rests {_where(x)}, not as {spec} on this mesh; place "
            "them first with params = jzero.shard_params(params, mesh) (the same layout= as "
            "here), then call init and train with those."
        )


def _where(x: Any) -> str:
    """Where ``x`` rests, for a message: its spec, its devices, or what it is instead."""
    if not isinstance(x, jax.Array):
        return f"as {article(type(x).__name__)} (not on any device)"
    if isinstance(x.sharding, NamedSharding):
        return f"as {x.sharding.spec}"
    n = len(x.sharding.device_set)
    return f"on {n} device{'s' if n > 1 else ''} ({type(x.sharding).__name__})"


def onto_mesh(tree: Any, mesh: Mesh) -> Any:
    """Outside ``jit``: arrays on other devices than ``mesh``'s (e.g. gradients computed on
    one device) copied onto it, replicated, so that they meet the sharded state; inside
    ``jit`` (tracers) and on the mesh already, as they are."""
    devices = set(mesh.devices.flat)

    def onto(x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        if x.sharding.device_set == devices:
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(onto, tree)
