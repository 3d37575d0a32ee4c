"""``jzero.shard_params``: parameters at rest along ``data``, as stage 3 of
:func:`jzero.shard_optimizer` keeps them (true shapes, :mod:`.layout`)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..gpu_target.compile_only import check_runnable
from ..input_checks import check_leaves
from ..optimizer import ZeroOptimizer
from ..options.layout import Layout
from ..options.zero_config import ZeroConfig
from .layout import user_layout


def stage3_specs(params: Any, mesh: Mesh, layout: Layout | None) -> Any:
    """The tree of ``PartitionSpec`` s stage 3 keeps ``params`` in."""
    config = ZeroConfig(stage=3, layout=layout or Layout())
    opt = ZeroOptimizer(optax.identity(), mesh, config=config)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return user_layout(opt, shapes).params


def shard_params(params: Any, mesh: Mesh, *, layout: Layout | None = None) -> Any:
    """``params`` laid out along ``mesh``'s ``data`` axis, as ZeRO stage 3 keeps them.

    Each leaf is sharded along the dimension ``jzero.ZeroOptimizer`` would pick, where the
    ``data`` axis's size divides it (true shapes: no padding); other leaves, and scalars,
    stay replicated over ``data``. ``layout`` (a :class:`jzero.Layout`: ``param_specs``
    over the mesh's other axes, ``rules``, ``min_shard_size``) must be the one given to
    :func:`jzero.shard_optimizer`. Inside ``jit`` this constrains the layout; outside it
    moves the arrays (the caller's unsharded copies stay alive while referenced).

    Examples:
        >>> params = jzero.shard_params(params, mesh)
        >>> tx = jzero.shard_optimizer(optax.adamw(3e-4), mesh, stage=3)
        >>> opt_state = tx.init(params)
    """
    check_runnable(mesh, "jzero.shard_params")
    check_leaves(params, "params", allow_empty=False)
    specs = stage3_specs(params, mesh, layout)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


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
        named = isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
        now = x.sharding.spec if named else f"a {type(x).__name__} on no mesh"
        raise ValueError(
            f"stage 3 keeps the parameters sharded along 'data', but params"
            f"{jax.tree_util.keystr(path)} rests as {now}, not {spec} on this mesh; place them "
            "first with params = jzero.shard_params(params, mesh) (the same layout= as "
            "here), then call init and train with those."
        )


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
