"""Which primitive is which, by primitive object, and what a value's type says about it.

jzero's rules tell equations apart by :class:`Kind` (never by a primitive's name), read the
mesh axes a value varies over through :func:`varying_axes` alone, and let remat policies
read a primitive's parameters only through the functions at the end of this module.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import jax
from jax._src.core import ShapedArray, pvary_p  # pvary: the cast JAX adds before a psum
from jax._src.lax.parallel import reduce_scatter_p  # psum_scatter's primitive
from jax.extend.core import ClosedJaxpr, Literal, Primitive, Var
from jax.extend.core import primitives as prims


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


ELEMENTWISE = frozenset(
    {
        *(prims.add_p, prims.sub_p, prims.mul_p, prims.div_p, prims.rem_p, prims.neg_p),
        *(prims.abs_p, prims.sign_p, prims.max_p, prims.min_p, prims.clamp_p, prims.sqrt_p),
        *(prims.rsqrt_p, prims.cbrt_p, prims.pow_p, prims.integer_pow_p, prims.square_p),
        *(prims.exp_p, prims.exp2_p, prims.log_p, prims.log1p_p, prims.expm1_p, prims.tanh_p),
        *(prims.logistic_p, prims.select_n_p, prims.convert_element_type_p, prims.copy_p),
        *(prims.eq_p, prims.ne_p, prims.lt_p, prims.le_p, prims.gt_p, prims.ge_p, prims.and_p),
        *(prims.or_p, prims.not_p, prims.is_finite_p, prims.reduce_precision_p),
    }
)
"""Primitives that map each element of their operands to the same element of the result."""

_KINDS: dict[Primitive, Kind] = {
    prims.jit_p: Kind.CALL,
    prims.closed_call_p: Kind.CALL,
    prims.remat_p: Kind.REMAT,
    prims.scan_p: Kind.SCAN,
    prims.cond_p: Kind.COND,
    prims.while_p: Kind.WHILE,
    prims.custom_vjp_call_p: Kind.CUSTOM_VJP,
    prims.custom_jvp_call_p: Kind.CUSTOM_JVP,
    pvary_p: Kind.PVARY,
    prims.axis_index_p: Kind.AXIS_INDEX,
    prims.broadcast_in_dim_p: Kind.BROADCAST,
    prims.slice_p: Kind.SLICE,
    prims.dynamic_slice_p: Kind.SLICE,
    **dict.fromkeys(ELEMENTWISE, Kind.ELEMENTWISE),
}

AXIS_PARAMS = ("axes", "axis_name")
"""The parameters through which a collective (psum, all_gather, axis_index, pvary, ...)
names mesh axes."""

_COLLECTIVES = {  # primitive -> the jax.lax function a user calls, for messages
    prims.psum_p: "psum/pmean",
    prims.pmax_p: "pmax",
    prims.pmin_p: "pmin",
    prims.all_gather_p: "all_gather",
    prims.axis_index_p: "axis_index",
    reduce_scatter_p: "psum_scatter",
    prims.all_to_all_p: "all_to_all",
    prims.ppermute_p: "ppermute",
    pvary_p: "pcast",
}


def kind(prim: Primitive) -> Kind:
    return _KINDS.get(prim, Kind.OTHER)


def api_name(prim: Primitive) -> str:
    """The ``jax.lax`` function that binds ``prim`` (its name when jzero knows no other)."""
    return _COLLECTIVES.get(prim, prim.name)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes the value ``x`` varies over inside ``jax.shard_map`` (empty
    outside it, and for values that are not arrays)."""
    return _varying(jax.typeof(x))


def traced_varying_axes(atom: Var | Literal) -> frozenset:
    """:func:`varying_axes` of a jaxpr variable or literal, as it was traced."""
    return _varying(atom.aval)


def _varying(aval: Any) -> frozenset:
    return aval.mat.varying if isinstance(aval, ShapedArray) else frozenset()


# What remat policies read: a policy is called as ``policy(prim, *avals, **params)``.


def is_trimming_pad(prim: Primitive, params: dict[str, Any]) -> bool:
    """Whether ``prim`` is a ``lax.pad`` with a negative high padding (a trim) on some axis."""
    return prim is jax.lax.pad_p and any(hi < 0 for _, hi, _ in params["padding_config"])


def is_copy_to_device(prim: Primitive, params: dict[str, Any]) -> bool:
    """Whether ``prim`` is a ``jax.device_put`` into the device's own memory (inside
    ``jit``: a copy in from host memory, e.g. of an offloaded parameter shard)."""
    return prim is prims.device_put_p and any(
        d == jax.memory.Space.Device for d in params["devices"]
    )


def checkpoint_name_of(prim: Primitive, params: dict[str, Any]) -> str | None:
    """The name ``jax.ad_checkpoint.checkpoint_name`` gave a value, if ``prim`` is its."""
    return params["name"] if prim is prims.name_p else None


def custom_vjp_body(prim: Primitive, params: dict[str, Any]) -> Iterator[tuple[Primitive, dict]]:
    """``(primitive, params)`` of each top-level equation of a ``custom_vjp`` function's
    primal computation; nothing for any other primitive."""
    if prim is not prims.custom_vjp_call_p:
        return
    body = params["call_jaxpr"]
    for eqn in (body.jaxpr if isinstance(body, ClosedJaxpr) else body).eqns:
        yield eqn.primitive, eqn.params
