"""What a compiled training step holds and sends per device, measured beside the theory.

:func:`report` reads the live state's shards, the compiled step's memory analysis and the
collectives of its optimized HLO, and sets each beside docs/design.md §1's formulas. On a
hybrid mesh (a ``replica`` axis) it also splits the traffic by the mesh axes each
collective's device groups span, beside the theory per axis.

Examples:
    >>> step = opt.train_step(loss_fn, manual_gather=True)  # doctest: +SKIP
    >>> print(jzero.report(step, state, batch))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from .._table import table
from ..core.input_checks import check_live
from ..core.plan import Plan, ZeroState
from .estimate import (
    ACROSS,
    WITHIN,
    theory_comm_bytes,
    theory_comm_bytes_hpz,
    theory_comm_bytes_per_axis,
    theory_model_state_bytes,
)
from .hlo import Collective, collectives, comm_bytes, comm_bytes_by_axis, dot_flops, summary_table
from .memory_spaces import of_compiled

_MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
_MEMORY_FIELDS += ("host_argument", "host_output", "host_alias", "host_temp")  # offload
CPU_NOTE = (
    "XLA:CPU runs 16-bit collectives in f32, so on CPU a bf16 model's measured "
    "communication is about twice the theory."
)
QUANT_NOTE = (
    "the s8 all-gathers (and their f32 scales) are stage 3's quantized parameter gathers "
    "(Communication.gather_quant; u8 holds fp8 values); the theory counts every gather in "
    "the parameters' dtype."
)
GRAD_QUANT_NOTE = (
    "the s8/u8 all-to-alls (and their f32 scales) are quantized gradient reduce-scatters "
    "(Communication.grad_quant; u8 holds two int4 values); the theory counts them as "
    "reduce-scatters in the reduce dtype."
)


def _ratio(measured: float, theory: float) -> float | None:
    """measured / theory; None when the theory is 0 (e.g. no communication on 1 device)."""
    return measured / theory if theory else None


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-device bytes of one compiled training step, measured and in theory.

    Attributes:
        stage: ZeRO stage of the state.
        devices: the devices N model states are sharded over (``plan.data_size``; with
            hybrid sharding the data-group size G).
        num_params: parameter count Ψ (true shapes, padding excluded).
        params_bytes: parameters held at rest (live arrays, one addressable shard each).
        grads_bytes: gradients held per device, *derived from the plan*, not measured:
            stages 0/1 the full local gradient; stages 2/3 the padded shard of each sharded
            leaf plus the full gradient of each replicated leaf.
        opt_bytes: optimizer state held at rest, fp32 master weights included (live
            arrays, one addressable shard each).
        theory_model_state_bytes: docs/design.md §1 with Ψ and the actual bytes per
            parameter (optimizer state: a single-device copy's bytes / Ψ).
        peak_bytes: compiled peak per device, ``argument + output + temp - alias`` from
            ``compiled.memory_analysis()``; -1 when the backend gives no analysis.
        memory: the raw memory-analysis fields (``<name>_size_in_bytes``), in bytes; the
            ``host_*`` ones count host memory (an offloaded optimizer's state on GPU;
            XLA:CPU has one memory and counts everything as device memory).
        collectives: every collective of the optimized HLO, with its trip count.
        comm_bytes: bytes sent per device per step in the ring model, by kind and total.
        theory_comm_bytes: 2·S·(N−1)/N (stages 0-2) or 3·S·(N−1)/N (stage 3), S = one
            full copy of the parameters in the gradient dtype; with hybrid sharding the
            sum of ``theory_comm_bytes_by_axis``.
        notes: caveats that apply to these numbers (e.g. the CPU's f32 collectives).
        replicas: R, the ``replica`` axis's size (1 without one).
        comm_bytes_by_axis: the measured bytes by the mesh axes a collective's device
            groups span (``'data'``, ``'replica'``; ``'replica+data'`` for one spanning
            both, e.g. the loss mean), from :func:`jzero.accounting.hlo.comm_bytes_by_axis`.
        theory_comm_bytes_by_axis: ``{'data': ...}``, with hybrid sharding also
            ``'replica'``: :func:`~jzero.accounting.estimate.theory_comm_bytes_per_axis`.
        bytes_by_memory_kind: the live parameters, optimizer state and master weights
            per device by the memory kind they rest in (``'device'``; ``'pinned_host'``
            for an offloaded optimizer's state and master weights).
        params_bytes_by_memory_kind: the parameters' part of ``bytes_by_memory_kind``
            (``'pinned_host'`` for stage 3's offloaded parameter shards).
        hpz: the step's secondary partition size G (``Communication.hpz``), or None. With
            it, the traffic within the 'data' axis is split into ``'data(across)'`` (the
            collectives among the devices at one position of every group of G) and
            ``'data(within)'`` (among one group's devices); what spans the whole axis
            stays ``'data'``. Theory: :func:`~jzero.accounting.estimate.theory_comm_bytes_hpz`.
        secondary_bytes: with ``hpz``, the secondary copies forward keeps for backward in
            theory, Ψ·bytes/G (part of ``peak_bytes``); else 0.
        peak_bytes_by_space: the compiled program's peak per memory space,
            ``{'device': ..., 'pinned_host': ...}``, from its scheduled HLO
            (:func:`jzero.accounting.memory_spaces.peak_by_space`): what an offload saves
            shows here on any backend, where ``peak_bytes`` (XLA:CPU's one memory) does not.
        dot_flops: matrix-multiply FLOPs per device per step, 2·M·N·K of every ``dot`` of
            the optimized HLO times its runs (:func:`jzero.accounting.hlo.dot_flops`): a
            matrix optimizer's (Muon's Newton-Schulz) is its step's less AdamW's. -1 where
            XLA lowers dots to library calls (a GPU compile) or a loop's count is unknown.
    """

    stage: int
    devices: int
    num_params: int
    params_bytes: int
    grads_bytes: int
    opt_bytes: int
    theory_model_state_bytes: float
    peak_bytes: int
    memory: dict[str, int]
    collectives: tuple[Collective, ...]
    comm_bytes: dict[str, float]
    theory_comm_bytes: float
    notes: tuple[str, ...] = ()
    replicas: int = 1
    comm_bytes_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    theory_comm_bytes_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_memory_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    params_bytes_by_memory_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    hpz: int | None = None
    secondary_bytes: float = 0.0
    peak_bytes_by_space: dict[str, int] = dataclasses.field(default_factory=dict)
    dot_flops: int = -1

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.opt_bytes

    @property
    def model_state_ratio(self) -> float | None:
        """Measured over theory model states; None when the theory is 0 (no parameters)."""
        return _ratio(self.model_state_bytes, self.theory_model_state_bytes)

    @property
    def comm_ratio(self) -> float | None:
        """Measured over theory communication; None when the theory is 0 (one device)."""
        return _ratio(self.comm_bytes["total"], self.theory_comm_bytes)

    @property
    def comm_ratio_by_axis(self) -> dict[str, float | None]:
        """Measured over theory communication per mesh axis that has a theory."""
        measured = self.comm_bytes_by_axis
        return {
            k: _ratio(measured.get(k, 0.0), t) for k, t in self.theory_comm_bytes_by_axis.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able numbers, lists and strings; an undefined ratio is None.

        No NaN or infinity anywhere, so ``json.dumps(..., allow_nan=False)`` accepts it.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["collectives"] = [
            c._asdict() | {"shape": list(c.shape), "ring_bytes": c.ring_bytes}
            for c in self.collectives
        ]
        d["notes"] = list(self.notes)
        return d | {
            "model_state_bytes": self.model_state_bytes,
            "model_state_ratio": self.model_state_ratio,
            "comm_ratio": self.comm_ratio,
            "comm_ratio_by_axis": self.comm_ratio_by_axis,
        }

    def __str__(self) -> str:
        ratio = lambda r: "-" if r is None else f"{r:.4f}"  # None: theory 0, see the notes
        row = lambda name, b, theory=None, r="": (
            name,
            f"{b:,.0f}",
            "" if theory is None else f"{theory:,.0f}",
            r,
        )
        states, theory_states = self.model_state_bytes, self.theory_model_state_bytes
        comm = self.comm_bytes["total"]
        in_params = self.params_bytes_by_memory_kind
        in_opt = {k: b - in_params.get(k, 0) for k, b in self.bytes_by_memory_kind.items()}
        kinds = lambda by_kind: (  # offloaded: where the states rest
            [row(f"  in {k}", by_kind[k]) for k in sorted(by_kind, key=_device_first) if by_kind[k]]
            if set(by_kind) - {"device"}
            else []
        )
        rows = [
            ("per device", "measured", "theory", "ratio"),
            row("params", self.params_bytes),
            *kinds(in_params),
            row("grads (from plan)", self.grads_bytes),
            row("optimizer state", self.opt_bytes),
            *kinds(in_opt),
        ]
        rows += [
            row("model states", states, theory_states, ratio(self.model_state_ratio)),
            row("peak (compiled)", self.peak_bytes),
            *[row(f"  in {k} (schedule)", b) for k, b in self.peak_bytes_by_space.items() if b],
            *([row("  hpZ secondary (theory)", self.secondary_bytes)] if self.hpz else []),
            row("comm / step (ring)", comm, self.theory_comm_bytes, ratio(self.comm_ratio)),
        ]
        rows += [row(f"  {k}", v) for k, v in self.comm_bytes.items() if k != "total"]
        if self.dot_flops >= 0:
            rows.append(("matmul FLOPs / step", f"{self.dot_flops:,}", "", ""))
        devices = f"{self.devices} device" + ("s" if self.devices != 1 else "")
        if len(self.theory_comm_bytes_by_axis) > 1:  # hybrid or hpZ: traffic per mesh axis
            theory, ratios = self.theory_comm_bytes_by_axis, self.comm_ratio_by_axis
            for axis in dict.fromkeys([*theory, *self.comm_bytes_by_axis]):
                measured = self.comm_bytes_by_axis.get(axis, 0.0)
                r = ratio(ratios[axis]) if axis in theory else ""
                rows.append(row(f"  over {axis}", measured, theory.get(axis), r))
        if self.replicas > 1:
            devices = f"{self.replicas} x {self.devices} devices (replica x data)"
        if self.hpz:
            devices += f", hpZ groups of {self.hpz}"
        head = f"jzero stage {self.stage} on {devices}, {self.num_params:,} params"
        lines = [head, table(rows, right={1, 2, 3}), "", summary_table(list(self.collectives))]
        lines += [f"note: {n}" for n in (*self.notes, *self._ratio_notes())]
        return "\n".join(lines)

    def _ratio_notes(self) -> list[str]:
        """Why a ratio prints as "-": its theory is 0 bytes, so measured / theory is undefined."""
        notes = []
        if self.model_state_ratio is None:
            notes.append("no model states in theory (0 parameters), so no model-state ratio.")
        if self.comm_ratio is None:
            where = "on 1 device" if self.devices == 1 else "in theory"
            notes.append(f"no communication {where}, so no comm ratio.")
        return notes


def _one_shard_bytes(x: Any) -> int:
    """One device's shard of ``x``, a live array or an abstract one (``jax.eval_shape``'s,
    e.g. a state for compile-only GPUs: :func:`jzero.gpu_mesh`)."""
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def _shard_bytes(tree: Any) -> int:
    return sum(_one_shard_bytes(x) for x in jax.tree.leaves(tree))


def _device_first(kind: str) -> tuple[bool, str]:
    return kind != "device", kind


def _bytes_by_memory_kind(tree: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        kind = x.sharding.memory_kind or "device"
        out[kind] = out.get(kind, 0) + _one_shard_bytes(x)
    return out


def _grad_bytes(plan: Plan, itemsizes: list[int]) -> int:
    total = 0
    for lay, size in zip(plan.layouts, itemsizes):
        if plan.stage >= 2 and lay.sharded:
            total += math.prod(lay.padded) // plan.data_size * size
        else:
            total += math.prod(lay.shape) * size
    return total


def _memory(compiled: Any) -> tuple[int, dict[str, int]]:
    stats = compiled.memory_analysis()
    if stats is None:
        return -1, {}
    raw = {k: int(getattr(stats, f"{k}_size_in_bytes", 0)) for k in _MEMORY_FIELDS}
    return raw["argument"] + raw["output"] + raw["temp"] - raw["alias"], raw


def report(train_step: Any, state: ZeroState, batch: Any) -> Report:
    """Compiles ``train_step`` for ``(state, batch)`` and reports its per-device bytes.

    Args:
        train_step: the jitted step from ``ZeroOptimizer.train_step`` (anything with
            ``.lower(state, batch).compile()``). Nothing is run; ``state`` is not donated.
        state: a :class:`ZeroState` with live arrays (one consumed by a donating step is
            refused with a ``ValueError``), or an abstract one (``jax.eval_shape`` of
            ``opt.init_program``'s), e.g. for compile-only GPUs (:func:`jzero.gpu_mesh`).
        batch: a batch of the shapes the step is trained on.

    Raises:
        ValueError: a collective sits in a loop whose trip count XLA does not know.
    """
    check_live(state)
    compiled = train_step.lower(state, batch).compile()
    hpz = getattr(getattr(train_step, "comm", None), "hpz", None)
    return report_compiled(compiled, state, hpz=hpz)


def report_compiled(compiled: Any, state: ZeroState, *, hpz: int | None = None) -> Report:
    """:func:`report` of a step compiled already for ``state`` (a ``jax.stages.Compiled``,
    e.g. the one :meth:`jzero.autoconfig.Choice.report` keeps from its search), with
    ``hpz`` its ``Communication.hpz``. Compiles nothing."""
    check_live(state)
    plan = state.plan
    n = plan.data_size
    peak, memory = _memory(compiled)
    text = compiled.as_text()
    colls = tuple(collectives(text))
    by_axis = _bytes_by_axis(list(colls), dict(plan.mesh.shape), hpz)

    itemsizes = [np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params)]
    num_params = sum(math.prod(lay.shape) for lay in plan.layouts)
    param_total = sum(math.prod(lay.shape) * s for lay, s in zip(plan.layouts, itemsizes))
    opt_sizes = [np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.opt_state)]
    opt_total = sum(math.prod(lay.shape) * s for lay, s in zip(plan.opt_layouts, opt_sizes))
    if state.master is not None:  # fp32 master weights count as optimizer state (K)
        opt_total += 4 * num_params
    per_param = param_total / max(num_params, 1)
    theory_states = theory_model_state_bytes(
        params=num_params,
        devices=n,
        stage=plan.stage,
        param_bytes=per_param,
        grad_bytes=per_param,  # gradients take their parameter's dtype
        opt_bytes=opt_total / max(num_params, 1),
    )
    theory_comm = {
        "data": theory_comm_bytes(stage=plan.stage, param_bytes_S=param_total, devices=n)
    }
    if plan.hybrid:
        theory_comm = theory_comm_bytes_per_axis(
            stage=plan.stage, param_bytes_S=param_total, devices=n, replicas=plan.replica_size
        )
    if hpz:
        theory_comm = theory_comm_bytes_hpz(
            param_bytes_S=param_total, devices=n, group=hpz, replicas=plan.replica_size
        )
    on_cpu = any(d.platform == "cpu" for d in jax.tree.leaves(state.params)[0].sharding.device_set)
    notes = (CPU_NOTE,) if on_cpu and min(itemsizes, default=4) < 4 else ()
    if any(c.kind == "all-gather" and c.dtype in ("s8", "u8", "s4", "u4") for c in colls):
        notes += (QUANT_NOTE,)
    if any(c.kind == "all-to-all" and c.dtype in ("s8", "u8") for c in colls):
        notes += (GRAD_QUANT_NOTE,)
    return Report(
        stage=plan.stage,
        devices=n,
        num_params=num_params,
        params_bytes=_shard_bytes(state.params),
        grads_bytes=_grad_bytes(plan, itemsizes),
        opt_bytes=_shard_bytes((state.opt_state, state.master)),
        theory_model_state_bytes=theory_states,
        peak_bytes=peak,
        memory=memory,
        collectives=colls,
        comm_bytes=comm_bytes(list(colls)),
        theory_comm_bytes=sum(theory_comm.values()),
        notes=notes,
        replicas=plan.replica_size,
        comm_bytes_by_axis=by_axis,
        theory_comm_bytes_by_axis=theory_comm,
        bytes_by_memory_kind=_bytes_by_memory_kind((state.params, state.opt_state, state.master)),
        params_bytes_by_memory_kind=_bytes_by_memory_kind(state.params),
        hpz=hpz,
        secondary_bytes=param_total / hpz if hpz else 0.0,
        peak_bytes_by_space=of_compiled(compiled, text),
        dot_flops=_dot_flops(text) if on_cpu else -1,
    )


def _dot_flops(text: str) -> int:
    try:
        return dot_flops(text)
    except ValueError:  # a dot in a loop of unknown trip count
        return -1


def _bytes_by_axis(colls: list[Collective], mesh_shape: dict[str, int], hpz: int | None):
    """:func:`comm_bytes_by_axis` over the mesh (device i of the compiled program is the
    mesh's i-th device), its 'data' axis seen as (across, within) hpZ's groups of ``hpz``:
    consecutive data indices form a group, so this is a row-major split of the axis."""
    if not hpz:
        return comm_bytes_by_axis(colls, mesh_shape)
    split = {}
    for name, size in mesh_shape.items():
        split |= {ACROSS: size // hpz, WITHIN: hpz} if name == "data" else {name: size}
    whole = f"{ACROSS}+{WITHIN}"
    out = {}
    for key, b in comm_bytes_by_axis(colls, split).items():
        key = key.replace(whole, "data")
        out[key] = out.get(key, 0.0) + b
    return out
