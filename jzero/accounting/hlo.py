"""Collectives in an optimized XLA HLO module, and their bytes in the ring model.

Reads the text of a compiled module (``jax.jit(f).lower(*args).compile().as_text()``)
and lists every all-reduce, reduce-scatter, all-gather, all-to-all and
collective-permute, with how many times it runs per call of the program.

Examples:
  >>> hlo = jax.jit(step).lower(state, batch).compile().as_text()  # doctest: +SKIP
  >>> comm_bytes(hlo)["total"]  # doctest: +SKIP
"""

import functools
import math
import re
from typing import NamedTuple

from .._table import table

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

# Computation header, e.g. `ENTRY %main.10 (p: f32[8]) -> f32[8] {` (never indented).
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Instruction, e.g. `  ROOT %psum.7 = f32[1024]{0} all-reduce(%p), ...`: name, rest.
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# One array in a shape, e.g. `bf16[8,128]{1,0}` -> ('bf16', '8,128'); `s32[]` -> ('s32', '').
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
# Computations an instruction calls: `body=%b`, `calls=%f`, `branch_computations={%a, %b}`.
_CALLS = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"')  # while's backend_config
# Replica-group forms printed by XLA: classic list `{{0,1},{2,3}}` (or `{}`: all devices),
# iota list `[num_groups,group_size]<=[8]...`, and mesh axes
# `mesh['a'=4,'b'=2](, device_ids=(...))? {'a'}` (a sub-axis prints as `'a':(1)2`;
# `maximal_mesh[device_id=0] {}` is one device).
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,\s]*\})?")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=(?:maximal_)?mesh\[([^\]]*)\][^{]*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([\w.\-]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+)'?(?::\(\d+\)(\d+))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


class Collective(NamedTuple):
    """One collective of an HLO module (one per array of a tuple-shaped, combined one)."""

    kind: str  # one of KINDS
    dtype: str  # HLO element type, e.g. 'f32', 'bf16'
    shape: tuple[int, ...]  # result shape (of this tuple element, for combined ops)
    group_size: int  # participants per replica group (devices named, for a permute)
    result_bytes: int
    operand_bytes: int  # from the result, group size and the op's semantics
    trip_count: int | None  # runs per program call; None: inside a loop of unknown trip count
    computation: str  # name of the HLO computation that holds it
    name: str  # HLO instruction name (shared by the elements of a combined op)

    @property
    def ring_bytes(self) -> float:
        """Bytes each device sends per run, in the ring model."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.operand_bytes)
        if self.kind == "all-reduce":
            return 2 * self.operand_bytes * (n - 1) / n
        if self.kind == "all-gather":
            return self.result_bytes * (n - 1) / n
        return self.operand_bytes * (n - 1) / n  # reduce-scatter, all-to-all


def _split_shape(rest: str) -> tuple[str, str]:
    """Splits `(f32[2], s32[]) while(...)` into the shape and what follows it."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    raise ValueError(f"unbalanced parentheses in HLO shape: {rest[:80]!r}")


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    bits = {"pred": 8, "token": 0}.get(dtype) or int(re.search(r"\d+", dtype)[0])
    return -(-math.prod(shape) * bits // 8)


def _group_size(attrs: str, num_devices: int) -> int:
    if m := _GROUPS_LIST.search(attrs):
        return len(re.findall(r"\d+", m[1])) if m[1] else num_devices
    if m := _GROUPS_IOTA.search(attrs):
        return int(m[1])
    if m := _GROUPS_MESH.search(attrs):
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(m[1])}
        axes = _GROUP_AXIS.findall(m[2].replace(" ", ""))
        return math.prod(int(sub) if sub else sizes[name] for name, sub in axes)
    if m := _PAIRS.search(attrs):
        return len(set(re.findall(r"\d+", m[1])))
    return num_devices  # no replica_groups attribute: all devices


def collectives(hlo_text: str, *, num_devices: int | None = None) -> list[Collective]:
    """Lists the collectives of an optimized HLO module, in text order.

    An async pair (`all-gather-start`/`-done`, or any `<kind>-start`/`-done`) counts once.
    A collective inside a `while` body runs `known_trip_count` times (nested loops
    multiply; a computation called from several places sums them; every branch of a
    `conditional` counts as run once); with no known trip count, `trip_count` is None.

    Args:
      hlo_text: `compiled.as_text()` of a jitted function.
      num_devices: devices meant by an empty `replica_groups={}`; defaults to the
        header's `num_partitions` times `replica_count`.
    """
    if num_devices is None:
        header = hlo_text[: hlo_text.find("\n")]
        counts = re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", header)
        num_devices = math.prod(int(c) for c in counts)
    instrs = {}  # name -> (computation, shape, opcode, tail)
    callers = {}  # computation -> [(calling computation, runs per call or None)]
    comp, entry = None, None
    for line in hlo_text.splitlines():
        if (h := _HEADER.match(line)) and not line.startswith("HloModule"):
            comp = h[2]
            entry = comp if h[1] else entry
        elif (m := _INSTR.match(line)) and comp is not None:
            shape, tail = _split_shape(m[2])
            opcode, _, tail = tail.partition("(")
            instrs[m[1]] = (comp, shape, opcode, tail)
            if opcode in ("async-done", "async-update"):
                continue  # the async-start already calls the wrapped computation
            trip = int(t[1]) if (t := _TRIP.search(tail)) else None
            for attr, names in _CALLS.findall(tail):
                runs = 1 if opcode != "while" else trip
                if attr == "condition" and trip is not None:
                    runs = trip + 1
                for callee in re.findall(r"[\w.\-]+", names.replace("%", "")):
                    callers.setdefault(callee, []).append((comp, runs))

    @functools.cache
    def runs(c: str) -> int | None:  # times computation `c` runs per program call
        if c == entry or (entry is None and c not in callers):
            return 1
        calls = [(runs(caller), n) for caller, n in callers.get(c, [])]
        calls = [(outer, n) for outer, n in calls if outer != 0]
        if any(outer is None or n is None for outer, n in calls):
            return None
        return sum(outer * n for outer, n in calls)

    found = []
    for name, (comp, shape, opcode, tail) in instrs.items():
        kind = opcode.removesuffix("-done")
        if kind not in KINDS or (trips := runs(comp)) == 0:
            continue
        attrs = tail
        if opcode.endswith("-done"):  # attributes live on the -start (via any -update)
            start = name
            while not instrs[start][2].endswith("-start"):
                start = re.search(r"%([\w.\-]+)", instrs[start][3])[1]
            attrs = instrs[start][3]
        n = _group_size(attrs, num_devices)
        for dtype, dims in _ARRAY.findall(shape):
            dims = tuple(int(d) for d in dims.replace("<=", "").split(",") if d)
            nbytes = _nbytes(dtype, dims)
            operand = {"all-gather": nbytes // n, "reduce-scatter": nbytes * n}.get(kind, nbytes)
            found.append(Collective(kind, dtype, dims, n, nbytes, operand, trips, comp, name))
    return found


def comm_bytes(hlo: str | list[Collective]) -> dict[str, float]:
    """Bytes sent per device per program call, by kind, in the ring model.

    Returns:
      `{'all-reduce', 'reduce-scatter', 'all-gather', 'other', 'total'}` -> bytes:
      the sum of `ring_bytes * trip_count` (all-to-all and collective-permute in 'other').

    Raises:
      ValueError: a collective sits in a loop whose trip count XLA does not know.
    """
    out = dict.fromkeys(("all-reduce", "reduce-scatter", "all-gather", "other", "total"), 0.0)
    for c in collectives(hlo) if isinstance(hlo, str) else hlo:
        if c.trip_count is None:
            raise ValueError(
                f"{c.kind} %{c.name} in computation %{c.computation} runs inside a while "
                "loop with no known_trip_count, so its bytes per step are unknown; use a "
                "lax.scan / fori_loop with static bounds, or count this loop by hand."
            )
        key = c.kind if c.kind in out else "other"
        out[key] += c.ring_bytes * c.trip_count
        out["total"] += c.ring_bytes * c.trip_count
    return out


def summary_table(colls: list[Collective]) -> str:
    """An aligned text table: one row per collective, then the total bytes."""
    rows = [("kind", "dtype", "shape", "group", "trips", "ring bytes", "x trips", "computation")]
    for c in colls:
        known = c.trip_count is not None
        total = f"{c.ring_bytes * c.trip_count:,.0f}" if known else "?"
        shape = "[" + ",".join(map(str, c.shape)) + "]"
        trips = str(c.trip_count) if known else "?"
        ring = f"{c.ring_bytes:,.0f}"
        rows.append((c.kind, c.dtype, shape, str(c.group_size), trips, ring, total, c.computation))
    if all(c.trip_count is not None for c in colls):
        rows.append(("total", "", "", "", "", "", f"{comm_bytes(colls)['total']:,.0f}", ""))
    return table(rows, right={3, 4, 5, 6})  # the numbers: group, trips and the bytes
