"""Collectives in an optimized XLA HLO module, and their bytes in the ring model.

Reads the text of a compiled module (``jax.jit(f).lower(*args).compile().as_text()``)
and lists every all-reduce, reduce-scatter, all-gather, all-to-all and
collective-permute, with how many times it runs per call of the program.

Examples:
  >>> hlo = jax.jit(step).lower(state, batch).compile().as_text()  # doctest: +SKIP
  >>> comm_bytes(hlo)["total"]  # doctest: +SKIP
"""

import functools
import itertools
import math
import re
from collections.abc import Callable
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
_IOTA = re.compile(r"\[([\d,]*)\](?:T\(([\d,]*)\))?")  # `[2,4]T(1,0)`: iota, reshaped, transposed
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]*\](?:T\([\d,]*\))?)")
_DEVICE_IDS = re.compile(r"device_ids=\((\[[\d,]*\](?:T\([\d,]*\))?|[\d,\s]*)\)")
_MAXIMAL = re.compile(r"replica_groups=maximal_mesh\[device_id=(\d+)\]")


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
    # The replica groups as device (partition) ids, the i-th being the i-th device of the
    # program's device assignment (a jitted program on a mesh: ``mesh.devices.flat``); the
    # source-target pairs of a permute; () where the form was not understood.
    groups: tuple[tuple[int, ...], ...] = ()

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


def _iota(text: str) -> list[int]:
    """`[2,4]T(1,0)` -> the ids 0..7 laid out as a 2x4 array, transposed (1, 0), flat."""
    m = _IOTA.fullmatch(text)
    dims = [int(d) for d in m[1].split(",") if d]
    perm = [int(p) for p in m[2].split(",")] if m[2] else list(range(len(dims)))
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    return [
        sum(i * strides[d] for i, d in zip(index, perm))
        for index in itertools.product(*(range(dims[d]) for d in perm))
    ]


def _grid_groups(ids: list[int], shape: list[int], dims: list[int]) -> list[tuple[int, ...]]:
    """Groups of ``ids`` (row-major over ``shape``) varying along ``dims``, in that order."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    rest = [d for d in range(len(shape)) if d not in dims]
    at = lambda fixed, moving: sum(
        i * strides[d] for i, d in itertools.chain(zip(fixed, rest), zip(moving, dims))
    )
    over = lambda ds: list(itertools.product(*(range(shape[d]) for d in ds)))
    return [tuple(ids[at(f, m)] for m in over(dims)) for f in over(rest)]


def _mesh_groups(attrs: str, m: re.Match, num_devices: int) -> list[tuple[int, ...]]:
    """Groups of the `mesh[...]` form; a sub-axis `'a':(p)k` splits axis `a` into (p, k, rest)."""
    sizes = [(name, int(size)) for name, size in _MESH_AXIS.findall(m[1])]
    split = {}  # axis -> (pre-size, size) of the one sub-axis the groups name
    named = []
    for name, pre, sub in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", m[2].replace(" ", "")):
        if sub:
            split[name] = (int(pre), int(sub))
        named.append((name, bool(sub)))
    shape, index = [], {}  # expanded dims; (axis, is sub-axis) -> dim
    for name, size in sizes:
        pre, sub = split.get(name, (1, size))
        index[(name, name in split)] = len(shape) + (1 if name in split else 0)
        shape += [pre, sub, size // (pre * sub)] if name in split else [size]
    ids = list(range(math.prod(shape)))
    if d := _DEVICE_IDS.search(attrs):
        ids = _iota(d[1]) if d[1].startswith("[") else [int(i) for i in re.findall(r"\d+", d[1])]
    return _grid_groups(ids, shape, [index[key] for key in named])


def _groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups (or a permute's pairs) as device ids; () if not understood."""
    try:
        if m := _GROUPS_LIST.search(attrs):
            if not m[1]:
                return (tuple(range(num_devices)),)
            text = attrs[m.start() : attrs.index("}}", m.start()) + 2]
            return tuple(
                tuple(map(int, re.findall(r"\d+", g))) for g in re.findall(r"\{([\d,\s]*)\}", text)
            )
        if m := _GROUPS_IOTA_FULL.search(attrs):
            ids, size = _iota(m[3]), int(m[2])
            return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))
        if m := _MAXIMAL.search(attrs):
            return ((int(m[1]),),)
        if m := _GROUPS_MESH.search(attrs):
            return tuple(_mesh_groups(attrs, m, num_devices))
        if m := _PAIRS.search(attrs):
            return tuple(tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m[1]))
    except (AttributeError, IndexError, KeyError, ValueError, ZeroDivisionError):
        return ()
    if "replica_groups=" in attrs:
        return ()
    return (tuple(range(num_devices)),)  # no replica_groups attribute: all devices


def _program(hlo_text: str) -> tuple[dict, Callable[[str], int | None]]:
    """The module's instructions, ``name -> (computation, shape, opcode, tail)``, and how
    many times each computation runs per program call (None: in a loop of unknown trip
    count; ``while`` bodies run ``known_trip_count`` times, nested loops multiply)."""
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

    return instrs, runs


_DIMS = re.compile(r"\b(lhs|rhs)_contracting_dims=\{([\d,]*)\}")


def dot_flops(hlo_text: str) -> int:
    """2·M·N·K of every ``dot`` of an optimized HLO module (per device), times the runs of
    its computation: unlike ``compiled.cost_analysis()``, which counts a loop body once,
    it counts a scanned model's layers and micro-batches. Convolutions are not counted.

    Raises:
        ValueError: a dot sits in a loop whose trip count XLA does not know.
    """
    instrs, runs = _program(hlo_text)
    shapes = {name: _dims(shape) for name, (_, shape, _, _) in instrs.items()}
    total = 0
    for name, (comp, shape, opcode, tail) in instrs.items():
        if opcode != "dot":
            continue
        if (n := runs(comp)) is None:
            raise ValueError(f"dot {name} sits in a loop with no known_trip_count.")
        lhs = (re.search(r"%([\w.\-]+)", tail) or re.match(r"\s*([\w.\-]+)", tail))[1]
        contracting = dict(_DIMS.findall(tail)).get("lhs", "")
        k = math.prod(shapes[lhs][int(d)] for d in contracting.split(",") if d)
        total += 2 * math.prod(_dims(shape)) * k * n
    return total


def launches(found: list[Collective]) -> int:
    """Collectives a step launches: each HLO collective times its runs (its trip count; once
    where unknown). A combined (tuple-shaped) one counts once, though :func:`collectives`
    lists one entry per array: XLA merges the scalar all-reduces (loss, gradient norm) and
    dp's gradient all-reduces so."""
    runs = {(c.computation, c.name): c.trip_count or 1 for c in found}
    return sum(runs.values())


def _dims(shape: str) -> tuple[int, ...]:
    m = _ARRAY.search(shape)
    return tuple(int(d) for d in m[2].replace("<=", "").split(",") if d) if m else ()


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
    instrs, runs = _program(hlo_text)
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
        n, groups = _group_size(attrs, num_devices), _groups(attrs, num_devices)
        for dtype, dims in _ARRAY.findall(shape):
            dims = tuple(int(d) for d in dims.replace("<=", "").split(",") if d)
            nbytes = _nbytes(dtype, dims)
            operand = {"all-gather": nbytes // n, "reduce-scatter": nbytes * n}.get(kind, nbytes)
            found.append(
                Collective(kind, dtype, dims, n, nbytes, operand, trips, comp, name, groups)
            )
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


def mesh_axes(c: Collective, mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
    """The axes of a mesh (``{name: size}`` in mesh order, device ``i`` at row-major
    position ``i``) along which ``c``'s groups span devices; None if its groups are unknown.

    E.g. on ``{'replica': 2, 'data': 4}``: groups ``{0,1,2,3},{4,5,6,7}`` -> ``('data',)``,
    ``{0,4},{1,5},...`` -> ``('replica',)``, ``{0..7}`` -> ``('replica', 'data')``.
    """
    if not c.groups:
        return None
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = lambda i: [i // math.prod(sizes[k + 1 :]) % sizes[k] for k in range(len(sizes))]
    spanned = set()
    for group in c.groups:
        points = [coords(i) for i in group]
        spanned |= {k for k in range(len(names)) if len({p[k] for p in points}) > 1}
    return tuple(names[k] for k in sorted(spanned))


def comm_bytes_by_axis(colls: list[Collective], mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes sent per device per program call (ring model) by the mesh axes each collective's
    groups span: ``{'data': ..., 'replica': ...}``; a collective spanning several axes is
    keyed by their names joined with ``+`` (e.g. ``'replica+data'``), unknown groups by
    ``'?'``. Collectives within one device (no axis) send nothing and are left out.

    Raises:
      ValueError: a collective sits in a loop whose trip count XLA does not know.
    """
    out: dict[str, float] = {}
    for c in colls:
        comm_bytes([c])  # raises on an unknown trip count
        axes = mesh_axes(c, mesh_shape)
        if axes == ():
            continue
        key = "?" if axes is None else "+".join(axes)
        out[key] = out.get(key, 0.0) + c.ring_bytes * c.trip_count
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
