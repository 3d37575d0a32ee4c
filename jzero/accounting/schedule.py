"""Whether a compiled program's collectives overlap compute, read from its schedule.

A scheduled HLO module (``is_scheduled=true``, what ``compiled.as_text()`` prints) lists
each computation's instructions in the order they run. An asynchronous collective is a
``<kind>-start`` / ``<kind>-done`` pair (or ``async-start`` / ``async-done`` around a
computation that holds the collective): what the schedule puts between the two runs while
the data travels. :func:`collective_overlap` counts, for each collective, the compute
instructions (fusions, library calls, dots, convolutions, loops, calls) between its start
and its done; a synchronous collective (XLA:CPU's, or a GPU one the scheduler left
synchronous) overlaps nothing.

Examples:
  >>> text = jax.jit(step).lower(state, batch).compile().as_text()  # doctest: +SKIP
  >>> overlap_summary(collective_overlap(text))["overlapped_fraction"]  # doctest: +SKIP
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .hlo import _HEADER, _INSTR, KINDS, _split_shape, collectives

COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while", "call", "conditional")
"""Opcodes counted as compute when they sit between a collective's start and its done."""
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\bcalls=%?([\w.\-]+)")


class Overlap(NamedTuple):
    """One collective of a scheduled module and the compute scheduled under it."""

    kind: str  # one of jzero.accounting.hlo.KINDS
    name: str  # its instruction (the -done of an asynchronous pair)
    computation: str  # the HLO computation that holds it
    asynchronous: bool  # a start/done pair (False: one synchronous instruction)
    compute_between: int  # compute instructions scheduled between its start and its done
    trip_count: int | None  # runs per program call (jzero.accounting.collectives's)

    @property
    def overlaps(self) -> bool:
        return self.compute_between > 0


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str, str]]]:
    """``{computation: [(instruction, opcode, rest of the line), ...]}`` in schedule order."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        if (h := _HEADER.match(line)) and not line.startswith("HloModule"):
            current = comps.setdefault(h[2], [])
        elif (m := _INSTR.match(line)) and current is not None:
            _, tail = _split_shape(m[2])
            opcode, _, rest = tail.partition("(")
            current.append((m[1], opcode, rest))
    return comps


def _wrapped(rest: str, comps) -> tuple[str | None, tuple[str, str] | None]:
    """The collective an ``async-start`` wraps: its kind, and (computation, instruction)."""
    called = _CALLED.search(rest)
    for name, opcode, _ in comps.get(called[1] if called else "", []):
        if opcode in KINDS:
            return opcode, (called[1], name)
    return None, None


def _start_of(index: dict[str, int], body, done: int) -> int:
    """The position of a -done's -start, following any ``async-update`` in between."""
    position = done
    while True:
        operand = _OPERAND.search(body[position][2])
        position = index[operand[1]]
        if not body[position][1].endswith("-update"):
            return position


def _overlaps_in(comp: str, body, comps, trips: dict) -> list[Overlap]:
    index = {name: i for i, (name, _, _) in enumerate(body)}
    found = []
    for i, (name, opcode, _) in enumerate(body):
        if opcode in KINDS:
            found.append(Overlap(opcode, name, comp, False, 0, trips.get((comp, name))))
        elif opcode.endswith("-done"):
            start = _start_of(index, body, i)
            kind, key = opcode.removesuffix("-done"), (comp, name)
            if kind == "async":
                kind, key = _wrapped(body[start][2], comps)
            if kind in KINDS:
                between = sum(op in COMPUTE for _, op, _ in body[start + 1 : i])
                found.append(Overlap(kind, name, comp, True, between, trips.get(key)))
    return found


def collective_overlap(hlo_text: str) -> list[Overlap]:
    """Every collective of a scheduled HLO module (``compiled.as_text()``), in text order,
    with the compute instructions scheduled between its start and its done. A collective
    inside a computation that an ``async-start`` wraps is reported once, at the pair."""
    comps = _computations(hlo_text)
    wrapped = {
        c[1]
        for body in comps.values()
        for _, op, rest in body
        if op == "async-start" and (c := _CALLED.search(rest))
    }
    trips = {(c.computation, c.name): c.trip_count for c in collectives(hlo_text)}
    found = []
    for comp, body in comps.items():
        if comp not in wrapped:
            found += _overlaps_in(comp, body, comps, trips)
    return found


def overlap_summary(overlaps: list[Overlap], *, kind: str = "all-gather") -> dict[str, object]:
    """Counts for one kind of collective, each weighted by its runs per call (an unknown
    trip count as 1): how many run, how many are asynchronous, how many overlap compute,
    and the overlapped share (None when there are none)."""
    chosen = [o for o in overlaps if o.kind == kind]
    runs = lambda os: sum(o.trip_count or 1 for o in os)
    total = runs(chosen)
    overlapped = runs([o for o in chosen if o.overlaps])
    return {
        "kind": kind,
        "runs": total,
        "asynchronous": runs([o for o in chosen if o.asynchronous]),
        "overlapped": overlapped,
        "overlapped_fraction": overlapped / total if total else None,
        "instructions": len(chosen),
    }
