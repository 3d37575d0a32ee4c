"""Which axes of each input a traced function mixes: the axes an Optax update contracts,
reshapes together or otherwise needs whole, read from its jaxpr.

A dataflow pass over the jaxpr (nested bodies included): every value carries, per axis, the
set of input axes it came from (*origins*, ``(input, axis)``). An equation *mixes* an
origin when computing it on a partitioned array would need other partitions' elements in
bulk:

- ``dot_general`` contracting it, or holding it on a free axis of one side while the other
  side holds it too (``X @ X.T``: Muon's Newton-Schulz, Shampoo's preconditioners);
- ``reshape`` merging or splitting it with another non-unit axis;
- ``concatenate`` / ``rev`` / ``sort`` / cumulative ops along it;
- any value holding the same origin on two of its axes (``X + X.T``);
- a primitive this pass does not know, on any of its operands' origins (conservative).

Reductions (``reduce_sum`` and kin, ``argmax``) are recorded apart as *reduced*: on a
partitioned axis they cost an all-reduce of the reduced result, which that axis makes
smaller than the leaf (global norms, Adafactor's factored moments), so they do not ask for
whole matrices. Batch axes of ``dot_general`` (a ``vmap`` over stacked layers) and
elementwise work mix nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.extend.core import primitives as prims

from .equation import Equation, closed
from .moved import InternalMoved
from .primitives import ELEMENTWISE, Kind

Origin = tuple[int, int]  # (flat input index, axis of that input)
Labels = tuple[frozenset, ...]  # per axis of a value: the origins it holds


def _prims(*names: str) -> frozenset:
    return frozenset(p for p in (getattr(prims, n, None) for n in names) if p is not None)


_UNARY_SAME = _prims(
    *("sin_p", "cos_p", "tan_p", "asin_p", "acos_p", "atan_p", "sinh_p", "cosh_p", "asinh_p"),
    *("acosh_p", "atanh_p", "atan2_p", "erf_p", "erfc_p", "erf_inv_p", "lgamma_p", "digamma_p"),
    *("floor_p", "ceil_p", "round_p", "nextafter_p", "xor_p", "real_p", "imag_p", "conj_p"),
    *("shift_left_p", "shift_right_logical_p", "shift_right_arithmetic_p", "population_count_p"),
    *("clz_p", "copy_p", "copy_p", "sharding_constraint_p", "stop_gradient_p", "is_finite_p"),
    *("bitcast_convert_type_p", "polygamma_p", "igamma_p", "igammac_p", "random_gamma_grad_p"),
)
_REDUCE = _prims(
    *("reduce_sum_p", "reduce_max_p", "reduce_min_p", "reduce_prod_p", "reduce_and_p"),
    *("reduce_or_p", "reduce_xor_p", "argmax_p", "argmin_p", "reduce_p"),
)
_CUMULATIVE = _prims("cumsum_p", "cumprod_p", "cummax_p", "cummin_p", "cumlogsumexp_p")
_PASS_AXES = _prims("slice_p", "pad_p", "dynamic_slice_p")  # axis k of operand 0 -> axis k
_P = {
    n: getattr(prims, f"{n}_p", None)
    for n in (
        "dot_general",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "concatenate",
        "rev",
        "sort",
        "iota",
        "dynamic_update_slice",
        "select_n",
        "clamp",
    )
}


@dataclasses.dataclass
class MixedAxes:
    """Per flat input of a traced function, the axes it mixes and those it reduces; per
    flat output, the input axes each of its axes holds."""

    mixed: list[frozenset[int]]
    reduced: list[frozenset[int]]
    outputs: list[Labels]


class _Pass:
    """One analysis: the origins found mixed and reduced so far."""

    def __init__(self):
        self.mixed: set[Origin] = set()
        self.reduced: set[Origin] = set()

    def mix(self, *labels: frozenset) -> None:
        for origins in labels:
            self.mixed.update(origins)

    def run(self, jaxpr: ClosedJaxpr | Jaxpr, ins: Sequence[Labels]) -> list[Labels]:
        inner = closed(jaxpr).jaxpr
        env: dict[Any, Labels] = {v: _none(v) for v in inner.constvars}
        env.update(zip(inner.invars, ins))
        read = lambda a: _none(a) if isinstance(a, Literal) else env[a]
        for jaxpr_eqn in inner.eqns:
            eqn = Equation(jaxpr_eqn)
            outs = self.equation(eqn, [read(a) for a in jaxpr_eqn.invars])
            for v, labels in zip(jaxpr_eqn.outvars, outs):
                self.check_twice(labels)
                env[v] = labels
        return [read(a) for a in inner.outvars]

    def check_twice(self, labels: Labels) -> None:
        """An origin on two axes of one value (``X + X.T``) is mixed."""
        seen: set[Origin] = set()
        for origins in labels:
            self.mix(origins & seen)
            seen |= origins

    def equation(self, eqn: Equation, ins: list[Labels]) -> list[Labels]:
        prim, params = eqn.jaxpr_eqn.primitive, eqn.params
        outs = [v.aval for v in eqn.outputs]
        if prim in ELEMENTWISE or prim in _UNARY_SAME or prim in (_P["select_n"], _P["clamp"]):
            return [_elementwise(ins, len(getattr(a, "shape", ()))) for a in outs]
        if prim in _REDUCE:
            return [self.reduce(ins[0], params.get("axes", params.get("dimensions", ())))] * len(
                outs
            )
        if prim in _PASS_AXES:
            return [ins[0]]
        if prim is _P["dot_general"]:
            return [self.dot_general(ins[0], ins[1], params["dimension_numbers"])]
        if prim is _P["reshape"]:
            return [self.reshape(ins[0], eqn.shapes[0], tuple(outs[0].shape))]
        if prim is _P["transpose"]:
            return [tuple(ins[0][d] for d in params["permutation"])]
        if prim is _P["broadcast_in_dim"]:
            return [_broadcast(ins[0], len(outs[0].shape), params["broadcast_dimensions"])]
        if prim is _P["squeeze"]:
            return [tuple(o for d, o in enumerate(ins[0]) if d not in params["dimensions"])]
        if prim is _P["iota"]:
            return [_none(eqn.outputs[0])]
        if prim is _P["dynamic_update_slice"]:
            return [_elementwise(ins[:2], len(outs[0].shape))]
        if prim in _CUMULATIVE or prim in (_P["concatenate"], _P["rev"], _P["sort"]):
            return self.along_axes(prim, params, ins, len(outs))
        return self.nested(eqn, ins, outs)

    def reduce(self, x: Labels, axes: Sequence[int]) -> Labels:
        axes = {int(a) for a in axes}
        for d in axes:
            self.reduced.update(x[d])
        return tuple(o for d, o in enumerate(x) if d not in axes)

    def dot_general(self, lhs: Labels, rhs: Labels, numbers: Any) -> Labels:
        (lc, rc), (lb, rb) = numbers
        lf = [d for d in range(len(lhs)) if d not in lc and d not in lb]
        rf = [d for d in range(len(rhs)) if d not in rc and d not in rb]
        roles: dict[Origin, set] = {}
        for side, labels, c, b, f in (("l", lhs, lc, lb, lf), ("r", rhs, rc, rb, rf)):
            for d in c:
                for o in labels[d]:
                    roles.setdefault(o, set()).add("contracted")
            for i, d in enumerate(b):
                for o in labels[d]:
                    roles.setdefault(o, set()).add(("batch", i))
            for d in f:
                for o in labels[d]:
                    roles.setdefault(o, set()).add(("free", side))
        for origin, held in roles.items():
            if len(held) > 1 or "contracted" in held:
                self.mixed.add(origin)
        batch = tuple(lhs[i] | rhs[j] for i, j in zip(lb, rb))
        return batch + tuple(lhs[d] for d in lf) + tuple(rhs[d] for d in rf)

    def reshape(self, x: Labels, old: tuple[int, ...], new: tuple[int, ...]) -> Labels:
        """Axes kept whole pass through; a group of axes merged or split is mixed."""
        out: list[frozenset] = [frozenset()] * len(new)
        for ins, outs in _reshape_groups(old, new):
            origins = frozenset().union(*(x[d] for d in ins)) if ins else frozenset()
            if (
                len([d for d in ins if old[d] != 1]) > 1
                or len([d for d in outs if new[d] != 1]) > 1
            ):
                self.mix(origins)
            for d in outs:
                out[d] = origins if new[d] != 1 else frozenset()
        return tuple(out)

    def along_axes(self, prim: Any, params: Any, ins: list[Labels], n_out: int) -> list[Labels]:
        """concatenate / rev / sort / cumulative ops: the axes they work along are mixed."""
        axes = params.get("dimensions", params.get("dimension", params.get("axis")))
        axes = (axes,) if isinstance(axes, int) else tuple(axes or ())
        out = _elementwise(ins, len(ins[0]))
        for d in axes:
            self.mix(out[d])
        return [out] * n_out

    def nested(self, eqn: Equation, ins: list[Labels], outs: list[Any]) -> list[Labels]:
        kind = eqn.kind
        try:
            if kind in (Kind.CALL, Kind.CUSTOM_JVP, Kind.CUSTOM_VJP):
                body = eqn.call()
                if len(closed(body).jaxpr.invars) == len(ins):
                    return self.run(body, ins)
            elif kind is Kind.REMAT:
                return self.run(eqn.remat().body, ins)
            elif kind is Kind.SCAN:
                return self.scan(eqn, ins)
            elif kind is Kind.WHILE:
                return self.while_loop(eqn, ins)
            elif kind is Kind.COND:
                cond = eqn.cond(ins)
                results = [self.run(b, cond.operands) for b in cond.branches]
                return [_elementwise(list(r), len(r[0])) for r in zip(*results)]
        except InternalMoved:  # the whole analysis falls back (update_layout warns)
            raise
        except Exception:  # noqa: BLE001 -- a body this pass cannot read: be conservative
            pass
        return self.unknown(ins, outs)

    def unknown(self, ins: list[Labels], outs: list[Any]) -> list[Labels]:
        """A primitive this pass does not know: every origin of its operands is mixed, and
        every axis of its outputs holds them all."""
        everything = frozenset().union(*(o for x in ins for o in x))
        self.mix(everything)
        return [(everything,) * len(getattr(a, "shape", ())) for a in outs]

    def fixed_point(self, body: Any, consts: list, carry: list, rest: list, n: int) -> list:
        """The body's outputs once its carry's origins stop growing (each pass only adds)."""
        for _ in range(8):
            outs = self.run(body, [*consts, *carry, *rest])
            grown = [_elementwise([c, o], len(c)) for c, o in zip(carry, outs[:n])]
            if grown == carry:
                return outs
            carry = grown
        raise RuntimeError("no fixed point")

    def scan(self, eqn: Equation, ins: list[Labels]) -> list[Labels]:
        scan = eqn.scan(ins)
        slices = [x[1:] for x in scan.xs]
        n = len(scan.init)
        outs = self.fixed_point(scan.body, scan.consts, list(scan.init), slices, n)
        stacked = frozenset().union(*(x[0] for x in scan.xs)) if scan.xs else frozenset()
        if any(o for c in outs[:n] for o in c):  # a carry reads the scanned axis: mixed
            self.mix(stacked)
        return [*outs[:n], *((stacked, *y) for y in outs[n:])]

    def while_loop(self, eqn: Equation, ins: list[Labels]) -> list[Labels]:
        loop = eqn.while_loop(ins)
        return self.fixed_point(loop.body, loop.body_consts, list(loop.init), [], len(loop.init))


def _none(atom: Any) -> Labels:
    return (frozenset(),) * len(getattr(atom.aval, "shape", ()))


def _elementwise(ins: list[Labels], ndim: int) -> Labels:
    """Axis k of the result holds axis k of each operand of its rank (scalars add none)."""
    out = [frozenset()] * ndim
    for x in ins:
        if len(x) == ndim:
            out = [a | b for a, b in zip(out, x)]
    return tuple(out)


def _broadcast(x: Labels, ndim: int, dims: Sequence[int]) -> Labels:
    out = [frozenset()] * ndim
    for i, d in enumerate(dims):
        out[d] = x[i]
    return tuple(out)


def _reshape_groups(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list, list]]:
    """The reshape as groups of consecutive axes whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        ins, outs, a, b = [], [], 1, 1
        while True:
            if a <= b and i < len(old):
                a *= old[i]
                ins.append(i)
                i += 1
            elif j < len(new):
                b *= new[j]
                outs.append(j)
                j += 1
            else:
                break
            if a == b and (i == len(old) or old[i] != 1) and (j == len(new) or new[j] != 1):
                break
        groups.append((ins, outs))
    return groups


def equation_mixes(eqn: Equation, mine: Sequence[bool]) -> bool:
    """Whether one equation mixes the axes of its operands marked ``mine``."""
    analysis = _Pass()
    ins = []
    for k, (v, own) in enumerate(zip(eqn.inputs, mine)):
        ndim = len(getattr(v.aval, "shape", ()))
        ins.append(tuple(frozenset({(k, d)}) if own else frozenset() for d in range(ndim)))
    for labels in analysis.equation(eqn, ins):
        analysis.check_twice(labels)
    return bool(analysis.mixed)


def mixed_axes(jaxpr: ClosedJaxpr) -> MixedAxes:
    """Per flat input of ``jaxpr``, the axes the function mixes and those it reduces."""
    inner = closed(jaxpr).jaxpr
    ins = [
        tuple(frozenset({(k, d)}) for d in range(len(v.aval.shape)))
        for k, v in enumerate(inner.invars)
    ]
    analysis = _Pass()
    outputs = analysis.run(jaxpr, ins)
    per_input = lambda found: [
        frozenset(d for k2, d in found if k2 == k) for k in range(len(inner.invars))
    ]
    return MixedAxes(per_input(analysis.mixed), per_input(analysis.reduced), outputs)


def mixed_axes_of(fn: Any, *args: Any) -> MixedAxes:
    """:func:`mixed_axes` of ``fn`` traced on ``args`` (arrays or ``jax.ShapeDtypeStruct``
    trees), per flat leaf of ``args``. Raises :class:`.moved.InternalMoved` where a
    primitive's parameter this pass reads has moved (the trace's own errors pass)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    try:
        return mixed_axes(jaxpr)
    except KeyError as missing:
        raise InternalMoved(f"a primitive's parameter {missing}", "is gone") from None
