"""Peak bytes per memory space of a compiled program: device memory and pinned host memory.

``compiled.memory_analysis()`` gives one peak on XLA:CPU, whatever rests in host memory:
XLA:CPU has one memory and compiles the copies between memory kinds away. This module
reads the compiled, scheduled HLO instead (``compiled.as_text()``) and replays its
schedule: every buffer an instruction defines is live from that instruction to its last
use (an entry parameter from the start, an output to the end; a ``while``, tuple or
get-tuple-element aliases what it forwards), a ``while`` or ``call`` adds its body's own
peak while it runs, and each buffer belongs to one memory space:

- ``pinned_host`` where its layout says so (``S(5)``: an entry parameter or output in
  host memory, and on a GPU every value XLA's host offloader keeps there), or where a host
  computation defines it (``jax.experimental.compute_on``: ``_xla_compute_type="host"``,
  or on XLA:CPU, which inlines it, an ``op_name`` under ``compute_on``);
- ``device`` otherwise.

A device instruction that reads a host buffer needs a device copy of what it reads; on
XLA:CPU, where no copy instruction is left, that copy is counted on the device from the
buffer's first device read to its last in its computation (a slicing read: only the
slice, at that read). A device instruction that writes a host buffer holds it on the
device while it runs. The same holds the other way for a host computation and device
buffers. Where the program keeps its copies (a GPU's ``copy-start``/``copy-done``), their
buffers are read from their layouts like any other.

This is the program's own account, in the order its compiler scheduled it. It does not
model a GPU compiler that reorders copies differently from XLA:CPU's schedule, nor
allocator fragmentation: on a GPU, compare with the allocator's ``peak_bytes_in_use``
(``scripts/gpu_check/offload.py`` does).

Examples:
  >>> compiled = jax.jit(step).lower(state, batch).compile()  # doctest: +SKIP
  >>> peak_by_space(compiled.as_text())  # doctest: +SKIP
  {'device': 3692748, 'pinned_host': 1589760}
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from .hlo import _ARRAY, _CALLS, _HEADER, _INSTR, _nbytes, _split_shape

DEVICE, HOST = "device", "pinned_host"
SPACES = (DEVICE, HOST)
# Instructions whose result is (part of) an operand's buffers, not a new buffer.
_ALIASES = {"get-tuple-element", "tuple", "bitcast", "opt-barrier", "while", "parameter"}
_IN_PLACE = {"fusion", "add", "multiply", "subtract", "divide", "convert", "select", "copy"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_HOST_ATTR = re.compile(r'_xla_compute_type="host"|op_name="[^"]*/compute_on/')
_OPERANDS = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"entry_computation_layout=\{(.*)\}")
_DONATED = re.compile(r"\{\d*\}:\s*\((\d+),")  # input_output_alias: `{k}: (p, {}, ...)`


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    opcode: str
    elements: tuple[tuple[int, str | None], ...]  # per tuple element: bytes, layout space
    shape: str  # the result's shape and layout, as printed
    operands: tuple[str, ...]
    callees: tuple[str, ...]
    host: bool  # defined by a host computation
    index: int  # parameter number, tuple index; -1 otherwise


def _elements(shape: str) -> tuple[tuple[int, str | None], ...]:
    """Per top-level element of ``shape``: its bytes and ``HOST`` if its layout says S(5)."""
    parts = _top_level(shape[1:-1]) if shape.startswith("(") else [shape]
    out = []
    for part in parts:
        size = 0
        for dtype, dims in _ARRAY.findall(part):
            size += _nbytes(dtype, tuple(int(d) for d in dims.replace("<=", "").split(",") if d))
        out.append((size, HOST if "S(5)" in part else None))
    return tuple(out)


def _top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    tail = text[start:]
    return parts + [tail] if tail.strip() else parts


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str, str]:
    """The computations' instructions in schedule order, the entry's name, the header."""
    comps: dict[str, list[_Instr]] = {}
    comp, entry = None, None
    for line in hlo_text.splitlines():
        if (h := _HEADER.match(line)) and not line.startswith("HloModule"):
            comp = h[2]
            comps[comp] = []
            entry = comp if h[1] else entry
        elif (m := _INSTR.match(line)) and comp is not None:
            comps[comp].append(_instruction(m[1], m[2]))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text()")
    return comps, entry, hlo_text[: hlo_text.find("\n")]


def _instruction(name: str, text: str) -> _Instr:
    """One instruction from what follows its ``name =``: shape, opcode(operands), attrs."""
    shape, tail = _split_shape(text)
    opcode, _, rest = tail.partition("(")
    args, depth = "", 1
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            args, rest = rest[:i], rest[i + 1 :]
            break
    names = " ".join(found for _, found in _CALLS.findall(rest)).replace("%", "")
    callees = re.findall(r"[\w.\-]+", names)
    index = re.match(r"\s*(\d+)", args) if opcode == "parameter" else None
    index = index or re.search(r"\bindex=(\d+)", rest)
    return _Instr(
        name,
        opcode.strip(),
        _elements(shape),
        shape,
        tuple(_OPERANDS.findall(args)),
        tuple(callees),
        bool(_HOST_ATTR.search(rest)),
        int(index[1]) if index else -1,
    )


def _entry_layout(header: str) -> tuple[list[str | None], list[str | None], set[int]]:
    """The spaces of the entry's parameters and results, and the donated parameters."""
    m = _LAYOUT.search(header)
    params, results = [], []
    if m:
        text = m[1]
        depth = 0
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0 and text[i : i + 2] == "->":
                p, r = text[:i], text[i + 2 :]
                params = [s for _, s in _elements(p if p.startswith("(") else f"({p})")]
                results = [s for _, s in _elements(r)]
                break
    return params, results, {int(p) for p in _DONATED.findall(header)}


@dataclasses.dataclass
class _Walk:
    """One computation's replay so far: its values, and when each buffer lives."""

    end: int  # the index after the last instruction
    values: dict[str, list[frozenset[int]]] = dataclasses.field(default_factory=dict)
    start: dict[int, int] = dataclasses.field(default_factory=dict)  # buffer -> first index
    last: dict[int, int] = dataclasses.field(default_factory=dict)  # buffer -> last index
    shadows: list[tuple[int, int, int, str]] = dataclasses.field(default_factory=list)
    transient: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    reads: dict[tuple[int, str], list[int]] = dataclasses.field(default_factory=dict)
    shares: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class _Sim:
    """The replay of one computation's schedule, given its parameters' buffers."""

    def __init__(self, comps: dict[str, list[_Instr]], on_host: frozenset[int]):
        self.comps = comps
        self.on_host = on_host  # buffers the entry returns in host memory
        self.sizes: dict[int, tuple[int, str]] = {}  # buffer -> bytes, space
        self.shapes: dict[int, str] = {}  # buffer -> shape and layout (a single array's)
        self.returned: set[int] = set()  # what this replay found the entry returns there
        self.copied: dict[int, set[int]] = {}  # a copy's buffer -> its operand's
        self.named: dict[str, dict[str, _Instr]] = {}  # computation -> its instructions

    def new(self, size: int, space: str) -> int:
        b = len(self.sizes)
        self.sizes[b] = (size, HOST if b in self.on_host else space)
        return b

    def peak(self, comp, params, *, entry=False, results=(), donated=()) -> dict[str, int]:
        """Peak bytes per space while ``comp`` runs; ``params``: per parameter, per
        element, the buffers it is. The entry's parameters count (live throughout, as
        their caller holds them; a donated one until its last read), a called
        computation's are its caller's."""
        instrs = self.comps[comp]
        walk = _Walk(len(instrs))
        for i, ins in enumerate(instrs):
            operands = [walk.values.get(o, []) for o in ins.operands]
            here = self._where(ins, operands)
            if ins.opcode == "parameter":
                walk.values[ins.name] = params[ins.index] if ins.index < len(params) else []
                if entry:  # a donated buffer is XLA's to reuse once read for the last time
                    for b in set().union(*walk.values[ins.name]):
                        walk.start[b], walk.last[b] = -1, i if ins.index in donated else walk.end
            else:
                self._define(walk, i, ins, here, operands)
            self._read(walk, i, ins, here, operands)
            if ins.callees and ins.opcode != "fusion":
                walk.transient[i] = self._nested(ins, operands)
        self._close(walk, instrs, entry, results)
        return self._replay(walk, self._reused(walk.shares, walk.last, walk.values, instrs))

    def _where(self, ins: _Instr, operands: list) -> str:
        """The space ``ins`` runs in: XLA:CPU's copy of a host value stays there."""
        if ins.host:
            return HOST
        return HOST if ins.opcode == "copy" and self._space(operands) == HOST else DEVICE

    def _define(self, walk: _Walk, i: int, ins: _Instr, here: str, operands: list) -> None:
        """The buffers ``ins`` defines (or forwards), and what it holds across spaces."""
        if ins.opcode in _ALIASES:
            walk.values[ins.name] = self._alias(ins, operands)
            return
        if (into := self._updated_in_place(ins)) and into[0] < len(operands):
            walk.values[ins.name] = list(operands[into[0]])  # writes into its operand's buffer
            for b in set().union(*operands[into[0]]):
                if self.sizes[b][1] != here:  # only the update crosses
                    walk.shadows.append((i, i, into[1], here))
            return
        walk.values[ins.name] = [  # a constant lives in the executable, as XLA counts
            frozenset({self.new(0 if ins.opcode == "constant" else size, space or here)})
            for size, space in ins.elements
        ]
        for b in set().union(*walk.values[ins.name]):
            walk.start[b] = walk.last[b] = i
            if self.sizes[b][1] != here:  # written across: held here while it runs
                walk.shadows.append((i, i, self._written(ins, self.sizes[b][0]), here))
        if len(ins.elements) == 1:
            (out,) = walk.values[ins.name][0]
            self.shapes[out] = ins.shape
            if ins.opcode == "copy" and len(operands) == 1:
                self.copied[out] = set().union(*operands[0])
            if ins.opcode in _IN_PLACE:
                walk.shares += [(b, i) for vals in operands for e in vals for b in e]

    def _read(self, walk: _Walk, i: int, ins: _Instr, here: str, operands: list) -> None:
        """Extends the operands' lives to ``i``; a read across spaces needs a copy."""
        written = self._updated_in_place(ins)
        for k, vals in enumerate(operands):
            for b in set().union(*vals):
                walk.last[b] = max(walk.last.get(b, i), i)
                if ins.opcode in _ALIASES or self.sizes[b][1] == here:
                    continue
                if written and written[0] == k:
                    continue  # written into where it rests (counted by _define)
                if (part := self._sliced(ins, k)) is not None:  # only a slice crosses
                    walk.shadows.append((i, i, part, here))
                else:
                    walk.reads.setdefault((b, here), []).append(i)

    def _close(self, walk: _Walk, instrs: list[_Instr], entry: bool, results) -> None:
        """The root's buffers live to the end (the entry's returned in host memory are
        marked so); a cross-space read's copy spans its first to its last read."""
        root = walk.values.get(instrs[-1].name, []) if instrs else []
        for k, element in enumerate(root):
            for b in element:
                walk.last[b] = walk.end
                host = k < len(results) and results[k] == HOST
                if entry and host and walk.start.get(b, -1) >= 0:
                    self._return_on_host(b, walk.start)
        for (b, space), at in walk.reads.items():
            walk.shadows.append((min(at), max(at), self.sizes[b][0], space))

    def _reused(self, shares, last, values, instrs) -> set[int]:
        """Operand buffers an in-place instruction's output takes over (XLA shares a
        dead operand's buffer of the output's size with an elementwise result)."""
        reused, taken = set(), set()
        for b, i in shares:
            if last.get(b) != i or i in taken:
                continue
            (out,) = values[instrs[i].name][0]
            if self.sizes[b] == self.sizes[out] and self.shapes.get(b) == self.shapes[out]:
                reused.add(b)
                taken.add(i)
        return reused

    def _return_on_host(self, b: int, start: dict[int, int]) -> None:
        """Marks ``b`` (returned in host memory) host-resident, and what was copied into
        it: XLA:CPU copies a value it built in place (chunks written into a fresh host
        buffer) into the result, where a GPU's XLA builds it in host memory."""
        while b not in self.returned and start.get(b, -1) >= 0:
            self.returned.add(b)
            sources = self.copied.get(b, set())
            if len(sources) != 1:
                break
            (b,) = sources

    def _written(self, ins: _Instr, size: int) -> int:
        """The bytes ``ins`` computes of its ``size``-byte result: a fusion rooted in a
        pad computes its operand, the rest is the padding value."""
        body, root = self._fused_root(ins)
        if root is not None and root.opcode == "pad" and root.operands[0] in body:
            return _bytes(body[root.operands[0]])
        return size

    def _fused_root(self, ins: _Instr) -> tuple[dict[str, _Instr], _Instr | None]:
        """A fusion's computation by name, and its root seen through bitcasts."""
        if ins.opcode != "fusion" or not ins.callees or ins.callees[0] not in self.comps:
            return {}, None
        body = self._by_name(ins.callees[0])
        root = self.comps[ins.callees[0]][-1]
        while root.opcode == "bitcast" and root.operands and root.operands[0] in body:
            root = body[root.operands[0]]
        return body, root if root.operands else None

    def _by_name(self, comp: str) -> dict[str, _Instr]:
        if comp not in self.named:
            self.named[comp] = {i.name: i for i in self.comps[comp]}
        return self.named[comp]

    def _space(self, operands: list) -> str | None:
        """The one space of all of ``operands`` ' buffers, or None (none, or mixed)."""
        spaces = {self.sizes[b][1] for vals in operands for e in vals for b in e}
        return spaces.pop() if len(spaces) == 1 else None

    def _sliced(self, ins: _Instr, k: int) -> int | None:
        """The bytes ``ins`` reads of its operand ``k`` where it only slices it (a
        dynamic-slice, or a fusion whose parameter ``k`` feeds slices alone); else None."""
        if ins.opcode in _SLICING:
            return _bytes(ins) if k == 0 else None
        if ins.opcode != "fusion" or not ins.callees or ins.callees[0] not in self.comps:
            return None
        body = self.comps[ins.callees[0]]
        param = next((i.name for i in body if i.opcode == "parameter" and i.index == k), None)
        if param is None:
            return None
        users = [i for i in body if param in i.operands]  # few: a fusion is small
        if not users or any(u.opcode not in _SLICING or u.operands[0] != param for u in users):
            return None
        return sum(_bytes(u) for u in users)

    def _updated_in_place(self, ins: _Instr) -> tuple[int, int] | None:
        """The operand a dynamic-update-slice (or a fusion rooted in one) writes into, and
        the bytes it writes there."""
        if ins.opcode == "dynamic-update-slice":
            return 0, 0  # the update is an operand: its own buffer already counts
        body, root = self._fused_root(ins)
        if root is None or root.opcode != "dynamic-update-slice" or root.operands[0] not in body:
            return None
        target, update = body[root.operands[0]], body.get(root.operands[1])
        if target.opcode != "parameter":
            return None
        return target.index, _bytes(update) if update is not None else 0

    def _alias(self, ins: _Instr, operands: list) -> list[frozenset[int]]:
        if ins.opcode == "tuple":
            return [frozenset().union(*vals) for vals in operands]
        if ins.opcode == "get-tuple-element":
            vals = operands[0] if operands else []
            return [vals[ins.index]] if 0 <= ins.index < len(vals) else []
        return list(operands[0]) if operands else []  # bitcast, opt-barrier, while

    def _nested(self, ins: _Instr, operands: list) -> dict[str, int]:
        """The called computations' own peak (their parameters are the caller's)."""
        out = dict.fromkeys(SPACES, 0)
        args = operands if ins.opcode != "while" else [operands[0]] if operands else []
        for callee in ins.callees:
            if callee not in self.comps:
                continue
            inner = self.peak(callee, list(args))  # counts what the callee defines
            out = {s: max(out[s], inner[s]) for s in SPACES}
        return out

    def _replay(self, walk: _Walk, reused: set[int]) -> dict[str, int]:
        """The most bytes live at once per space, over the walk's events in order."""
        delta: dict[int, dict[str, int]] = {}

        def add(at: int, space: str, n: int) -> None:
            delta.setdefault(at, dict.fromkeys(SPACES, 0))[space] += n

        for b, first in walk.start.items():
            size, space = self.sizes[b]
            add(first, space, size)
            add(walk.last[b] + (b not in reused), space, -size)
        for first, final, size, space in walk.shadows:
            add(first, space, size)
            add(final + 1, space, -size)
        live, peak = dict.fromkeys(SPACES, 0), dict.fromkeys(SPACES, 0)
        for at in sorted(set(delta) | set(walk.transient)):
            live = {s: live[s] + delta.get(at, {}).get(s, 0) for s in SPACES}
            extra = walk.transient.get(at, {})
            peak = {s: max(peak[s], live[s] + extra.get(s, 0)) for s in SPACES}
        return peak


def peak_by_space(hlo_text: str, memory: Any = None) -> dict[str, int]:
    """``{'device': bytes, 'pinned_host': bytes}``: the most bytes live at once in each
    memory space while the compiled program ``hlo_text`` runs (its arguments included),
    per device.

    Args:
      hlo_text: ``compiled.as_text()``.
      memory: on a backend whose ``compiled.memory_analysis()`` counts host memory apart
        (a GPU's or TPU's XLA), that analysis: its own figures are returned, ``argument +
        output + temp - alias`` and the ``host_*`` fields likewise (its buffer
        assignment's, which the allocator sees). None on XLA:CPU, whose analysis has one
        memory: the replay of the schedule (:func:`replay`, the module's docstring).
        Without offload it is 0.79-1.12 x XLA:CPU's peak on the tested programs and the
        benchmark's GPT: XLA packs some buffers less tightly than their live ranges
        allow, and some loop carries tighter than the replay does.

    Raises:
      ValueError: ``hlo_text`` has no ENTRY computation.
    """
    return replay(hlo_text) if memory is None else _xla_figures(memory)


def _xla_figures(memory: Any) -> dict[str, int]:
    """``argument + output + temp - alias`` of a memory analysis, per space."""
    field = lambda name: int(getattr(memory, f"{name}_size_in_bytes", 0) or 0)
    device = field("argument") + field("output") + field("temp") - field("alias")
    host = field("host_argument") + field("host_output") + field("host_temp")
    return {DEVICE: device, HOST: host - field("host_alias")}


def of_compiled(compiled: Any, hlo_text: str | None = None) -> dict[str, int]:
    """:func:`peak_by_space` of a ``jax.stages.Compiled``: XLA's figures where its
    devices are not CPUs, else the replay (of ``hlo_text``, its ``as_text()``, if the
    caller has it already)."""
    devices = {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set}
    if not any(d.platform == "cpu" for d in devices):
        return _xla_figures(compiled.memory_analysis())
    return replay(compiled.as_text() if hlo_text is None else hlo_text)


def replay(hlo_text: str) -> dict[str, int]:
    """The peak per memory space of the replayed schedule (module docstring).

    Raises:
      ValueError: ``hlo_text`` has no ENTRY computation.
    """
    comps, entry, header = _parse(hlo_text)
    spaces, results, donated = _entry_layout(header)
    returned: frozenset[int] = frozenset()
    for _ in range(2):  # the second replay knows which buffers the entry returns on the host
        sim = _Sim(comps, returned)
        params = []
        for ins in comps[entry]:
            if ins.opcode == "parameter":
                space = spaces[ins.index] if ins.index < len(spaces) else None
                params += [[]] * (ins.index + 1 - len(params))
                b = sim.new(_bytes(ins), space or DEVICE)
                params[ins.index], sim.shapes[b] = [frozenset({b})], ins.shape
        peak = sim.peak(entry, params, entry=True, results=results, donated=donated)
        if sim.returned == returned:
            return peak
        returned = frozenset(sim.returned)
    return peak


def _bytes(ins: _Instr) -> int:
    return sum(size for size, _ in ins.elements)
