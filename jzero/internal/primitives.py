"""Which primitive is which, by primitive object, and what a value's type says about it.

jzero's rules tell equations apart by :class:`Kind` (never by a primitive's name), read the
mesh axes a value varies over through :func:`varying_axes` alone, and let remat policies
read a primitive's parameters only through the functions at the end of this module.
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal, Primitive, Var
from jax.extend.core import primitives as prims

from .moved import InternalMoved, param, warn_fallback

ShapedArray = getattr(jax.core, "ShapedArray", ())  # the type whose .mat holds varying axes

MISSING: list[str] = []
"""The primitives jzero looks for that this JAX does not have (``tests/test_jax_internals``
names them); equations of those kinds are then bound as traced, as :data:`Kind.OTHER`."""


def _prim(*names: str) -> Primitive | None:
    """The first of ``jax.extend.core.primitives``' attributes ``names`` that exists."""
    for name in names:
        found = getattr(prims, name, None)
        if isinstance(found, Primitive):
            return found
    MISSING.append(names[0])
    return None


class Kind(enum.Enum):
    """What an equation's primitive is, as far as jzero's rules care."""

    CALL = "call"  # jax.jit / closed_call: a jaxpr applied once
    REMAT = "remat"  # jax.checkpoint
    SCAN = "scan"  # lax.scan
    COND = "cond"  # lax.cond / lax.switch
    WHILE = "while"  # lax.while_loop / fori_loop
    CUSTOM_VJP = "custom_vjp"  # a jax.custom_vjp function
    CUSTOM_JVP = "custom_jvp"  # a jax.custom_jvp function
    PVARY = "pvary"  # the no-op invariant -> varying cast inside shard_map
    AXIS_INDEX = "axis_index"  # lax.axis_index
    BROADCAST = "broadcast"  # broadcast_in_dim
    SLICE = "slice"  # lax.slice / lax.dynamic_slice (what indexing an array binds)
    ELEMENTWISE = "elementwise"  # maps each element to the same element of its result
    OTHER = "other"


_ELEMENTWISE_NAMES = (
    *("add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min", "clamp", "sqrt"),
    *("rsqrt", "cbrt", "pow", "integer_pow", "square", "exp", "exp2", "log", "log1p", "expm1"),
    *("tanh", "logistic", "select_n", "convert_element_type", "copy", "eq", "ne", "lt", "le"),
    *("gt", "ge", "and", "or", "not", "is_finite", "reduce_precision"),
)
ELEMENTWISE = frozenset(p for p in (_prim(f"{n}_p") for n in _ELEMENTWISE_NAMES) if p)
"""Primitives that map each element of their operands to the same element of the result."""

_KINDS: dict[Primitive, Kind] = {
    **{
        p: k
        for p, k in (
            (_prim("jit_p"), Kind.CALL),
            (_prim("closed_call_p", "eval_jaxpr_p"), Kind.CALL),
            (_prim("remat_p"), Kind.REMAT),
            (_prim("scan_p"), Kind.SCAN),
            (_prim("cond_p"), Kind.COND),
            (_prim("while_p"), Kind.WHILE),
            (_prim("custom_vjp_call_p"), Kind.CUSTOM_VJP),
            (_prim("custom_jvp_call_p"), Kind.CUSTOM_JVP),
            (_prim("axis_index_p"), Kind.AXIS_INDEX),
            (_prim("broadcast_in_dim_p"), Kind.BROADCAST),
            (_prim("slice_p"), Kind.SLICE),
            (_prim("dynamic_slice_p"), Kind.SLICE),
        )
        if p is not None
    },
    **dict.fromkeys(ELEMENTWISE, Kind.ELEMENTWISE),
}
"""Kinds of the primitives ``jax.extend`` names; :func:`kinds` adds those only a trace shows."""

_DEVICE_PUT, _NAME = _prim("device_put_p"), _prim("name_p")
_CUSTOM_VJP = _prim("custom_vjp_call_p")

AXIS_PARAMS = ("axes", "axis_name")
"""The parameters through which a collective (psum, all_gather, axis_index, pvary, ...)
names mesh axes."""

_COLLECTIVES = {  # primitive -> the jax.lax function a user calls, for messages
    p: name
    for p, name in (
        (_prim("psum_p"), "psum/pmean"),
        (_prim("pmax_p"), "pmax"),
        (_prim("pmin_p"), "pmin"),
        (_prim("all_gather_p"), "all_gather"),
        (_prim("axis_index_p"), "axis_index"),
        (_prim("all_to_all_p"), "all_to_all"),
        (_prim("ppermute_p"), "ppermute"),
    )
    if p is not None
}
"""The collectives ``jax.extend`` names; :func:`collectives` adds those only a trace shows."""

_IN_SHARD_MAP: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    # api name -> a call of it inside shard_map on (x varying over 'a', w invariant); the
    # cast first, so that the casts the other calls bind are known as such
    "pcast": lambda x, w: jax.lax.pcast(w, "a", to="varying"),
    "psum/pmean": lambda x, w: jax.lax.psum(w, "a"),
    "pmax": lambda x, w: jax.lax.pmax(x, "a"),
    "pmin": lambda x, w: jax.lax.pmin(x, "a"),
    "all_gather": lambda x, w: jax.lax.all_gather(x, "a", tiled=True),
    "psum_scatter": lambda x, w: jax.lax.psum_scatter(x, "a", tiled=True),
    "all_to_all": lambda x, w: jax.lax.all_to_all(x, "a", 0, 0, tiled=True),
    "ppermute": lambda x, w: jax.lax.ppermute(x, "a", [(0, 1), (1, 0)]),
}


@functools.cache
def _traced_collectives() -> dict[Primitive, str]:
    """The primitives the public ``jax.lax`` collectives bind inside ``jax.shard_map`` with
    its varying-axes checks (``psum_invariant``, ``reduce_scatter``, ``pvary`` ...: not all
    are in ``jax.extend``), read from a trace on an abstract mesh (no device is touched).
    Traced on a thread of its own: outside whatever mesh context the caller is in."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_trace_collectives).result()


def _trace_collectives() -> dict[Primitive, str]:
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    mesh = AbstractMesh((2,), ("a",), axis_types=(AxisType.Auto,))
    x, w = jax.ShapeDtypeStruct((4,), jax.numpy.float32), jax.ShapeDtypeStruct((2,), "float32")
    found: dict[Primitive, str] = {}
    for name, call in _IN_SHARD_MAP.items():
        body = lambda x, w, call=call: _to_varying(call(x, w).sum())[None]
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("a"), P()), out_specs=P("a"))
        inner = jax.make_jaxpr(fn)(x, w).jaxpr.eqns[0].params["jaxpr"]
        own = [e.primitive for e in inner.eqns[: _own_equations(inner)]]
        known = {**_COLLECTIVES, **_KINDS, **found}
        found.update((p, name) for p in own if p not in known)
    return found


def _to_varying(x: jax.Array) -> jax.Array:
    return x if "a" in varying_axes(x) else jax.lax.pcast(x, "a", to="varying")


def _own_equations(jaxpr: Any) -> int:
    """How many leading equations of a traced body are the call's own, before the ``sum`` and
    the cast every body ends with."""
    names = [e.primitive.name for e in jaxpr.eqns]
    return max(i for i, n in enumerate(names) if n.startswith("reduce_sum"))


@functools.cache
def collectives() -> dict[Primitive, str]:
    """Every primitive jzero knows as a collective, with the ``jax.lax`` function a user
    calls for it; where the trace cannot be read, those ``jax.extend`` names (warned)."""
    try:
        return {**_COLLECTIVES, **_traced_collectives()}
    except Exception as e:  # a moved shard_map or jaxpr: the names jax.extend gives stand
        warn_fallback(
            "jzero's jaxpr interpreter",
            InternalMoved("the primitives jax.lax's collectives bind inside shard_map", f"({e})"),
            "psum's and pcast's forms inside shard_map are bound as traced (batch-axis "
            "aliases cannot rename them)",
            "no memory",
        )
        return _COLLECTIVES


@functools.cache
def pvary_primitive() -> Primitive | None:
    """What ``jax.lax.pcast(x, axes, to="varying")`` binds (JAX's ``pvary``)."""
    return next((p for p, n in collectives().items() if n == "pcast"), None)


def warn_missing_primitives() -> None:
    """Warns once (per missing primitive) when this JAX lacks a primitive jzero looks for."""
    for name in MISSING:
        warn_fallback(
            "jzero's jaxpr interpreter",
            InternalMoved(f"jax.extend.core.primitives.{name}", "is missing"),
            "equations of that primitive are bound whole, as traced (a scan or checkpoint "
            "that reads stage 3's parameters gets them gathered whole; an offloaded update "
            "is not split or chunked across it)",
            "up to the whole model's gathered parameters per device at stage 3",
        )


def kind(prim: Primitive) -> Kind:
    found = _KINDS.get(prim)
    if found is None:
        found = Kind.PVARY if prim is pvary_primitive() else Kind.OTHER
    return found


def is_collective(prim: Primitive) -> bool:
    """Whether ``prim`` is a collective over named mesh axes (or ``axis_index`` / ``pvary``)."""
    return prim in collectives()


def api_name(prim: Primitive) -> str:
    """The ``jax.lax`` function that binds ``prim`` (its name when jzero knows no other)."""
    return collectives().get(prim, prim.name)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes the value ``x`` varies over inside ``jax.shard_map`` (empty
    outside it, and for values that are not arrays)."""
    return _varying(jax.typeof(x))


def traced_varying_axes(atom: Var | Literal) -> frozenset:
    """:func:`varying_axes` of a jaxpr variable or literal, as it was traced."""
    return _varying(atom.aval)


def _varying(aval: Any) -> frozenset:
    if not isinstance(aval, ShapedArray):
        return frozenset()
    try:
        return aval.mat.varying
    except AttributeError:
        raise InternalMoved("ShapedArray.mat.varying (the mesh axes a value varies over)") from None


# What remat policies read: a policy is called as ``policy(prim, *avals, **params)``.


def is_trimming_pad(prim: Primitive, params: dict[str, Any]) -> bool:
    """Whether ``prim`` is a ``lax.pad`` with a negative high padding (a trim) on some axis."""
    return prim is jax.lax.pad_p and any(
        hi < 0 for _, hi, _ in param(params, "padding_config", "pad")
    )


def is_copy_to_device(prim: Primitive, params: dict[str, Any]) -> bool:
    """Whether ``prim`` is a ``jax.device_put`` into the device's own memory (inside
    ``jit``: a copy in from host memory, e.g. of an offloaded parameter shard)."""
    return prim is _DEVICE_PUT and any(
        d == jax.memory.Space.Device for d in param(params, "devices", "device_put")
    )


def checkpoint_name_of(prim: Primitive, params: dict[str, Any]) -> str | None:
    """The name ``jax.ad_checkpoint.checkpoint_name`` gave a value, if ``prim`` is its."""
    return param(params, "name", "name") if prim is _NAME else None


def custom_vjp_body(prim: Primitive, params: dict[str, Any]) -> Iterator[tuple[Primitive, dict]]:
    """``(primitive, params)`` of each top-level equation of a ``custom_vjp`` function's
    primal computation; nothing for any other primitive."""
    if prim is not _CUSTOM_VJP:
        return
    body = param(params, "call_jaxpr", "custom_vjp_call")
    for eqn in (body.jaxpr if isinstance(body, ClosedJaxpr) else body).eqns:
        yield eqn.primitive, eqn.params
