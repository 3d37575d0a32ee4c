"""One traced equation as jzero's rules read it, and walks over (nested) jaxprs.

Every read of a jaxpr outside ``jzero.internal`` goes through this module: :func:`trace`
makes one (``jax.make_jaxpr``), :func:`inputs` / :func:`outputs` name its variables,
:func:`constants` holds its constants' values, :func:`environment` binds them and its first
inputs, :func:`defined` lists every variable its top level holds, and an
:class:`Equation`'s :class:`~.primitives.Kind` matches a primitive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from .moved import InternalMoved, param
from .primitives import AXIS_PARAMS, Kind, api_name, is_collective, kind, traced_varying_axes


class Scan(NamedTuple):
    """A ``lax.scan`` equation's operands and parameters."""

    consts: list  # operands every iteration reads unchanged
    init: list  # the initial carry
    xs: list  # the scanned operands (leading axis: iterations)
    body: ClosedJaxpr  # (*body consts, *consts, *carry, *x slices) -> (*carry, *y slices)
    length: int
    reverse: bool
    unroll: int | bool


class Cond(NamedTuple):
    """A ``lax.cond`` / ``lax.switch`` equation: ``branches[index](*operands)``."""

    index: Any
    branches: tuple[ClosedJaxpr, ...]
    operands: list


class While(NamedTuple):
    """A ``lax.while_loop`` equation."""

    cond_consts: list
    body_consts: list
    init: list
    cond: ClosedJaxpr  # (*cond_consts, *carry) -> (keep going,)
    body: ClosedJaxpr  # (*body_consts, *carry) -> (*carry,)


class Remat(NamedTuple):
    """A ``jax.checkpoint`` equation's body and options."""

    body: ClosedJaxpr
    policy: Callable[..., Any] | None
    prevent_cse: bool


def closed(jaxpr: ClosedJaxpr | Jaxpr) -> ClosedJaxpr:
    """``jaxpr`` as a :class:`ClosedJaxpr` (an open one has no constants)."""
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, [])


def trace(fn: Callable[..., Any], *args: Any, return_shape: bool = False, **kwargs: Any):
    """``jax.make_jaxpr(fn, ...)(*args)``: the jaxpr of ``fn`` (and its output's shapes)."""
    return jax.make_jaxpr(fn, return_shape=return_shape, **kwargs)(*args)


def inputs(jaxpr: ClosedJaxpr | Jaxpr) -> list[Var]:
    """The jaxpr's input variables, in order."""
    return list(_open(jaxpr).invars)


def outputs(jaxpr: ClosedJaxpr | Jaxpr) -> list[Var | Literal]:
    """The jaxpr's outputs (variables, or literals), in order."""
    return list(_open(jaxpr).outvars)


def constants(jaxpr: ClosedJaxpr) -> list[Any]:
    """The closed jaxpr's constants' values, in order."""
    return list(jaxpr.consts)


def environment(jaxpr: ClosedJaxpr, values: Sequence[Any] = ()) -> dict[Var, Any]:
    """An environment holding the jaxpr's constants and, for its first inputs, ``values``."""
    env = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
    return env | dict(zip(jaxpr.jaxpr.invars, values))


def defined(jaxpr: ClosedJaxpr | Jaxpr) -> set[Var]:
    """Every variable of the jaxpr's top level: its inputs, constants and equations' outputs."""
    open_ = _open(jaxpr)
    made = {v for eqn in open_.eqns for v in eqn.outvars}
    return made | set(open_.invars) | set(open_.constvars)


def _open(jaxpr: ClosedJaxpr | Jaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def is_literal(atom: Var | Literal) -> bool:
    return isinstance(atom, Literal)


class Equation:
    """One equation of a traced jaxpr."""

    __slots__ = ("jaxpr_eqn",)

    def __init__(self, jaxpr_eqn: JaxprEqn):
        self.jaxpr_eqn = jaxpr_eqn  # for :mod:`.interpret` alone, which binds it

    def __repr__(self) -> str:
        return f"Equation({self.jaxpr_eqn})"

    @property
    def params(self) -> Mapping[str, Any]:
        """The primitive's parameters, as jzero's readers see them (binding uses the
        equation's own: :func:`.interpret.bind`)."""
        return self.jaxpr_eqn.params

    @property
    def kind(self) -> Kind:
        return kind(self.jaxpr_eqn.primitive)

    @property
    def api_name(self) -> str:
        """The ``jax.lax`` function that binds this equation's primitive, for messages."""
        return api_name(self.jaxpr_eqn.primitive)

    @property
    def inputs(self) -> tuple[Var | Literal, ...]:
        return tuple(self.jaxpr_eqn.invars)

    @property
    def outputs(self) -> tuple[Var, ...]:
        return tuple(self.jaxpr_eqn.outvars)

    @property
    def variables(self) -> tuple[Var, ...]:
        """The inputs that are variables (not literals)."""
        return tuple(v for v in self.jaxpr_eqn.invars if not isinstance(v, Literal))

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the inputs, then of the outputs."""
        return tuple(v.aval.shape for v in (*self.jaxpr_eqn.invars, *self.jaxpr_eqn.outvars))

    @property
    def where(self) -> str:
        """The innermost source line outside JAX that traced this equation (``file:line
        (function)``); '' when JAX recorded none (it keeps a limited number of frames)."""
        return source_info_util.summarize(self.jaxpr_eqn.source_info)

    # Collectives

    @property
    def axes(self) -> Any:
        """The mesh axes a collective names, as its ``axes`` / ``axis_name`` parameter holds
        them (a name or a tuple; a reduction's ``axes`` are positions, ints); None for a
        primitive with neither parameter."""
        params = self.params
        found = next((params[k] for k in AXIS_PARAMS if k in params), None)
        if found is None and is_collective(self.jaxpr_eqn.primitive):
            raise InternalMoved(
                f"{self.jaxpr_eqn.primitive.name}'s axes parameter {AXIS_PARAMS}",
                f"is gone (it has {sorted(params)})",
            )
        return found

    @property
    def axis_names(self) -> frozenset:
        """The mesh axis names in :attr:`axes`, as a set."""
        names = self.axes
        names = (names,) if isinstance(names, str) else names
        return frozenset(n for n in names or () if isinstance(n, str))

    def renamed(self, rename: Callable[[Any], Any]) -> dict[str, Any]:
        """The parameters with every axes parameter ``p`` replaced by ``rename(p)``."""
        self.axes  # noqa: B018 -- InternalMoved where a collective's axes parameter moved
        params = self.jaxpr_eqn.params
        return {k: rename(v) if k in AXIS_PARAMS else v for k, v in params.items()}

    # Higher-order primitives

    @property
    def subjaxprs(self) -> tuple[ClosedJaxpr, ...]:
        """The jaxprs this equation's parameters hold (bodies, branches), closed."""
        out = []
        for v in self.params.values():
            for j in v if isinstance(v, tuple | list) else (v,):
                if isinstance(j, ClosedJaxpr | Jaxpr):
                    out.append(closed(j))
        return tuple(out)

    def _param(self, name: str) -> Any:
        return param(self.params, name, self.jaxpr_eqn.primitive.name)

    def call(self) -> ClosedJaxpr:
        """A ``jit`` / ``closed_call`` (``eval_jaxpr``) equation's body: applied to its
        operands as they are."""
        params = self.params
        for key in ("jaxpr", "call_jaxpr"):
            if key in params:
                return closed(params[key])
        name = self.jaxpr_eqn.primitive.name
        raise InternalMoved(
            f"{name}'s parameter 'jaxpr' / 'call_jaxpr'", f"is gone ({sorted(params)})"
        )

    def remat(self) -> Remat:
        return Remat(
            closed(self._param("jaxpr")), self._param("policy"), self._param("prevent_cse")
        )

    def scan(self, operands: Sequence[Any]) -> Scan:
        """The scan's parts, ``operands`` (one per input, in order) split among them."""
        n_consts, n_carry = _scan_counts(self.params, len(self.jaxpr_eqn.invars))
        operands = list(operands)
        return Scan(
            operands[:n_consts],
            operands[n_consts : n_consts + n_carry],
            operands[n_consts + n_carry :],
            closed(self._param("jaxpr")),
            self._param("length"),
            self._param("reverse"),
            self._param("unroll"),
        )

    def cond(self, operands: Sequence[Any]) -> Cond:
        return Cond(operands[0], tuple(self._param("branches")), list(operands[1:]))

    def while_loop(self, operands: Sequence[Any]) -> While:
        nc, nb = self._param("cond_nconsts"), self._param("body_nconsts")
        operands = list(operands)
        return While(
            operands[:nc],
            operands[nc : nc + nb],
            operands[nc + nb :],
            closed(self._param("cond_jaxpr")),
            closed(self._param("body_jaxpr")),
        )

    def custom_vjp_args(self, operands: Sequence[Any]) -> list:
        """A ``custom_vjp`` equation's operands without the constants JAX puts first: the
        arguments the user's function was called with, flattened."""
        return list(operands[self._param("num_consts") :])

    @property
    def first_order(self) -> bool:
        """Whether the primitive computes its outputs from its operands alone: no jaxpr of
        its own (a call, loop, branch, checkpoint) and no custom differentiation rule."""
        return not self.subjaxprs and self.kind not in (Kind.CUSTOM_VJP, Kind.CUSTOM_JVP)

    # slice / dynamic_slice

    @property
    def takes_one_leading_index(self) -> bool:
        """Whether this ``lax.slice`` / ``lax.dynamic_slice`` takes ``x[i:i+1]`` of its
        first operand ``x`` along axis 0 and all of every other axis (``x[i]`` before its
        squeeze)."""
        if self.kind is not Kind.SLICE or not self.jaxpr_eqn.invars[0].aval.shape:
            return False
        p, shape = self.params, self.jaxpr_eqn.invars[0].aval.shape
        if "slice_sizes" in p:  # dynamic_slice: operand, then one start per axis
            return tuple(p["slice_sizes"]) == (1, *shape[1:])
        start, limit, strides = p["start_indices"], p["limit_indices"], p["strides"]
        whole = tuple(start[1:]) == (0,) * (len(shape) - 1) and tuple(limit[1:]) == shape[1:]
        unit = strides is None or all(s == 1 for s in strides)
        return whole and unit and limit[0] == start[0] + 1

    def leading_index(self, operands: Sequence[Any]) -> Any:
        """The ``i`` of :attr:`takes_one_leading_index` (an int, or the traced start of a
        dynamic slice), or None when it does not."""
        if not self.takes_one_leading_index:
            return None
        p = self.params
        return operands[1] if "slice_sizes" in p else p["start_indices"][0]

    # broadcast_in_dim

    @property
    def broadcasts_scalar(self) -> bool:
        """Whether a ``broadcast_in_dim`` broadcasts a scalar, with no sharding of its own."""
        eqn = self.jaxpr_eqn
        return eqn.invars[0].aval.shape == () and self.params.get("sharding") is None

    def broadcast_to(self, shape: Callable[[tuple[int, ...]], tuple[int, ...]]) -> dict:
        """A ``broadcast_in_dim``'s parameters with its result shape ``s`` replaced by
        ``shape(s)``."""
        new = shape(param(self.params, "shape", "broadcast_in_dim"))
        return {**self.jaxpr_eqn.params, "shape": new}


def _scan_counts(params: Any, n_operands: int) -> tuple[int, int]:
    """How many of a scan's operands are constants and how many the initial carry: read
    from ``ft_in`` (jax >= 0.11: the operands' flat trees, ``(consts, carry, xs)``) or from
    ``num_consts`` / ``num_carry`` (jax 0.10)."""
    if "num_consts" in params and "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = param(params, "ft_in", "scan")
    try:
        parts = [len(list(part)) for part in ft_in.update(list(range(n_operands))).unpack()]
    except (AttributeError, TypeError, ValueError) as e:
        raise InternalMoved("scan's parameter 'ft_in'", f"cannot be read ({e})") from None
    if len(parts) != 3 or sum(parts) != n_operands:
        raise InternalMoved("scan's parameter 'ft_in'", f"splits its operands as {parts}")
    return parts[0], parts[1]


def without_dead_equations(jaxpr: ClosedJaxpr | Jaxpr) -> ClosedJaxpr:
    """``jaxpr`` without the top-level equations whose results nothing reads and that have
    no effects. jax 0.11+ keeps them in a trace (e.g. the ``transpose`` behind an unused
    ``w.T.shape``), where they would read a parameter at the top of a loss: a read that
    is no layer's."""
    whole = closed(jaxpr)
    inner = whole.jaxpr
    live = {v for v in inner.outvars if isinstance(v, Var)}
    kept = []
    for eqn in reversed(inner.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, Var))
    if len(kept) == len(inner.eqns) or not hasattr(whole, "replace"):
        return whole  # (without replace: the dead equations only cost their compute)
    if whole is inner:  # jax >= 0.11: one class, constants included
        return whole.replace(eqns=kept[::-1])
    return ClosedJaxpr(inner.replace(eqns=kept[::-1]), whole.consts)


def equations(jaxpr: ClosedJaxpr | Jaxpr) -> list[Equation]:
    """The top-level equations of ``jaxpr``, in order."""
    return [Equation(e) for e in closed(jaxpr).jaxpr.eqns]


def only_indexed(jaxpr: ClosedJaxpr | Jaxpr, position: int) -> bool:
    """Whether ``jaxpr``'s input number ``position`` is read only by equations that take
    one index of its leading axis (:meth:`Equation.leading_index`), never whole: not by any
    other equation, nor returned."""
    inner = closed(jaxpr).jaxpr
    var = inner.invars[position]
    if any(v is var for v in inner.outvars):
        return False
    for eqn in equations(jaxpr):
        reads = [i for i, v in enumerate(eqn.inputs) if v is var]
        if reads and (reads != [0] or not eqn.takes_one_leading_index):
            return False
    return True


def walk(jaxpr: ClosedJaxpr | Jaxpr) -> Iterator[Equation]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, depth first."""
    for eqn in equations(jaxpr):
        yield eqn
        for sub in eqn.subjaxprs:
            yield from walk(sub)


def mentions(jaxpr: ClosedJaxpr | Jaxpr, names: Any) -> bool:
    """Whether an equation of ``jaxpr`` (or of a jaxpr nested in it) names one of
    ``names``: in a collective's axes, or in the mesh axes a value varies over."""
    names = frozenset(names)
    for eqn in walk(jaxpr):
        atoms = (*eqn.inputs, *eqn.outputs)
        if eqn.axis_names & names or any(traced_varying_axes(v) & names for v in atoms):
            return True
    return False
