"""``jzero.autoconfigure``: the configuration that fits a memory budget and runs fastest,
chosen by the compiler without a trial run.

The search, for a loss, its parameters, a global batch and a mesh:

1. **Prune with the estimator.** Per stage and offload (none; the optimizer step on the
   host for the whole state, or for a share near half of it, ZeRO-Offload++'s partial
   offload; with ``allow_delay``, ZeRO-Offload's delayed update), the model states alone
   (:func:`jzero.estimate`, with the Optax state's own bytes per parameter) must fit the
   device budget; a shape that cannot is dropped without compiling.
2. **Compile the plausible few**, ahead of time on abstract values (nothing runs): per
   remaining shape (stage, offload, recompute), the smallest gradient accumulation whose
   compiled step fits (the biggest micro-batch: fewest loop steps, fewest stage-2/3
   reduce-scatters); then, for the three fastest, buckets and prefetch; and the chosen
   configuration at the next-larger micro-batch, to show it does not fit
   (``Choice.larger``).
3. **Read each compiled step**: its peak per memory space
   (:func:`jzero.accounting.memory_spaces.of_compiled`), its collective bytes per device
   (:func:`jzero.accounting.comm_bytes`) and how many it launches, and its dot FLOPs
   (:func:`jzero.accounting.dot_flops`, loops counted per run), plus the bytes an
   offloaded optimizer moves and updates on the host (from its plan).
4. **Predict** each step's time with a :class:`.device_model.DeviceModel`, calibrated once
   per machine by a short probe (the host update measured as the host step runs it), and
   **choose** the fastest that fits; among those within ``tie`` (5 %) of it, the
   simplest (the lowest stage, the least offloaded, no delay, no recompute, then the
   fewest micro-batches). A delayed update's host work overlaps the next step's device
   work, so its time is the longer of the two, not their sum.

When nothing fits, the answer names the smallest budget that would, and with which
configuration (the lightest compiled candidate: stage 3, recompute, offload if allowed,
the most micro-batches).

The devices are ``mesh=``'s, or GPUs that are not here (``target=``, or a ``mesh=`` of
compile-only GPUs: :mod:`.target`). The search says what it does on stderr as it goes
(:mod:`.progress`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from .._table import table
from ..accounting import memory_spaces
from ..accounting.estimate import estimate
from ..accounting.hlo import collectives, comm_bytes, dot_flops, launches
from ..accounting.report import Report, report_compiled
from ..core.gpu_target.cluster import GPUS_PER_HOST
from ..core.gpu_target.compile_only import is_compile_only
from ..core.options.zero_config import ZeroConfig
from ..core.plan import Plan
from ..optimizers.zero_optimizer import ZeroOptimizer
from .candidates import (
    Shape,
    accumulations,
    collective_variants,
    describe,
    micro_batch,
    partial_share,
    shape_name,
    shapes,
)
from .device_model import DeviceModel, calibrate
from .progress import SearchProgress
from .target import OFFLOAD_NOTE, target_budget, target_mesh, target_model

TIE = 0.05
"""Candidates predicted within this fraction of the fastest count as equally fast."""
_MESH_OR_TARGET = "pass mesh= (the devices present) or target= (GPUs to plan for)"
COMPILE_ONLY_MESH_NOTE = (
    "mesh= holds compile-only GPUs (jzero.gpu_mesh), so the search plans for them as "
    "target= does: each candidate compiled for them, their memory times JAX's allocator "
    "share as the budget, datasheet rates"
)


class Row(NamedTuple):
    """One candidate of the search, as its table prints it."""

    name: str  # e.g. "zero3 host recompute bucket accum=2"
    config: ZeroConfig
    micro_batch: int  # rows per device per micro-batch
    estimate_bytes: float  # model states per device, by the estimator
    device_bytes: int | None  # compiled peak in device memory (None: not compiled)
    host_bytes: int | None  # compiled peak in pinned host memory
    collective_bytes: float | None  # ring bytes per device per step
    collectives: int | None  # collectives launched per step
    flops: float | None  # dot FLOPs per device per step
    seconds: float | None  # predicted step time
    dropped: str | None  # why it was not chosen (None: it fits)
    compile_seconds: float | None = None  # lowering and compiling it took (None: not compiled)

    @property
    def fits(self) -> bool:
        return self.dropped is None and self.seconds is not None


class ChosenStep:
    """The chosen configuration's step as the search compiled it (a
    ``jax.stages.Compiled``) and the abstract state it takes, for :meth:`Choice.report`.
    A pickled Choice keeps neither: an executable does not pickle."""

    def __init__(self, compiled: Any, state: Any):
        self.compiled, self.state = compiled, state

    def __reduce__(self):
        return ChosenStep, (None, None)


class Choice(NamedTuple):
    """What :func:`autoconfigure` found: the configuration (None when nothing fits), every
    candidate, and how long the search took."""

    config: ZeroConfig | None
    rows: tuple[Row, ...]
    device_budget: float
    host_budget: float | None
    device_model: DeviceModel
    search_seconds: float
    compiled: int  # candidates compiled
    smallest: Row | None  # when nothing fits: the lightest compiled candidate
    notes: tuple[str, ...] = ()  # what the search left out, and why (e.g. target=)
    larger: Row | None = None  # the chosen configuration at the next-larger micro-batch
    chosen_step: ChosenStep | None = None  # the search's compile of it, for report()

    @property
    def chosen(self) -> Row | None:
        return next((r for r in self.rows if r.config == self.config and r.fits), None)

    def report(self) -> Report:
        """:func:`jzero.report` of the chosen configuration's step, read from the compile
        the search made of it (Llama 3's 8 B and 70 B compiled for 8 and 64 GPUs in 20-39 s
        each on two cores, not spent again). Raises ``ValueError`` when nothing fits."""
        if self.config is None:
            raise ValueError(f"nothing to report: {nothing_fits(self)}.")
        if self.chosen_step is None or self.chosen_step.compiled is None:
            raise ValueError(
                "this Choice holds no compiled step (a pickled Choice leaves it behind): "
                "build the step with choice.config and call jzero.report(step, state, batch)."
            )
        step = self.chosen_step
        return report_compiled(step.compiled, step.state, hpz=self.config.comm.hpz)

    def table(self) -> str:
        """Every candidate: memory, collective bytes, predicted time, why it was dropped."""
        mb = lambda b: "-" if b is None else f"{b / 1e6:.2f}"
        head = ("candidate", "micro", "states MB", "device MB", "host MB", "comm MB")
        rows = [head + ("GFLOP", "predicted ms", "")]
        for r in self.rows:
            mark = "<- chosen" if r is self.chosen else (r.dropped or "")
            flops = "-" if r.flops is None else f"{r.flops / 1e9:.3f}"
            ms = "-" if r.seconds is None else f"{r.seconds * 1e3:.2f}"
            sizes = map(mb, (r.estimate_bytes, r.device_bytes, r.host_bytes, r.collective_bytes))
            rows.append((r.name, str(r.micro_batch), *sizes, flops, ms, mark))
        return table(rows)

    def summary(self) -> str:
        """One paragraph: the choice (or the smallest budget that would fit), the budgets,
        how many candidates were compiled and how long the search took."""
        took = f"{len(self.rows)} candidates, {self.compiled} compiled, {self.search_seconds:.1f} s"
        budget = f"device budget {self.device_budget / 1e6:,.1f} MB"
        if self.host_budget is not None:
            budget += f", host budget {self.host_budget / 1e6:,.1f} MB"
        notes = "".join(f" Note: {n}." for n in self.notes)
        if self.chosen is not None:
            row = self.chosen
            peak, ms = row.device_bytes / 1e6, row.seconds * 1e3
            return f"chosen: {row.name} (compiled peak {peak:,.2f} MB, predicted {ms:.2f} ms per step){_larger(self.larger)}; {budget}; {took}.{notes}"  # noqa: E501
        return f"{nothing_fits(self)}; {took}.{notes}"


def _larger(row: Row | None) -> str:
    """What the next-larger micro-batch of the chosen configuration compiled to."""
    if row is None or row.device_bytes is None:
        return ""
    verdict = "fits too" if row.fits else "over the budget"
    return (
        f"; its next-larger micro-batch ({row.micro_batch} rows per device) compiles to "
        f"{row.device_bytes / 1e6:,.2f} MB, {verdict}"
    )


def nothing_fits(choice: Choice) -> str:
    """The answer when no candidate fits: the smallest budget that would, and with what."""
    budget = f"no configuration fits a device budget of {choice.device_budget / 1e6:,.2f} MB"
    if choice.smallest is None:
        return budget + " (none could be compiled)"
    row = choice.smallest
    host = "" if not row.host_bytes else f" and {row.host_bytes / 1e6:,.2f} MB of host memory"
    return (
        f"{budget}: the smallest that would is {row.device_bytes / 1e6:,.2f} MB{host}, "
        f"with {row.name}"
    )


def select(rows: Sequence[Row], *, tie: float = TIE) -> Row | None:
    """The fastest row that fits; among those predicted within ``tie`` of it, the simplest
    (lowest stage, then the least offloaded, no delay, no recompute, fewest micro-batches),
    then the fastest
    (buckets and prefetch change no number, only the time). None when none fits."""
    fits = [r for r in rows if r.fits]
    if not fits:
        return None
    fastest = min(r.seconds for r in fits)
    close = [r for r in fits if r.seconds <= fastest * (1 + tie)]
    return min(close, key=lambda r: (_simplicity(r.config), r.seconds))


def _simplicity(config: ZeroConfig) -> tuple:
    return (
        config.stage,
        config.offload.ratio if config.offload.optimizer is not None else 0.0,
        config.offload.delay,
        config.step.remat_policy is not None,
        config.step.grad_accum,
    )


def default_device_budget(mesh: Mesh) -> float:
    """A device's memory: its allocator's limit, or on a backend that reports none (CPU)
    the host's memory shared by its local devices."""
    device = mesh.devices.flat[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / len([d for d in jax.local_devices() if d.platform == device.platform])


class _Problem(NamedTuple):
    """What every candidate is compiled for."""

    loss_fn: Callable[..., Any]
    shapes: Any  # the parameters' ShapeDtypeStructs
    batch: Any  # the global batch's ShapeDtypeStructs
    mesh: Mesh
    tx: optax.GradientTransformation
    rows: int  # the global batch's rows


def autoconfigure(
    loss_fn: Callable[..., Any],
    params: Any = None,
    *,
    batch: Any,
    mesh: Mesh | None = None,
    tx: optax.GradientTransformation,
    init_fn: Callable[[], Any] | None = None,
    config: ZeroConfig | None = None,
    device_budget: float | None = None,
    host_budget: float | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    allow_delay: bool = False,
    device_model: DeviceModel | None = None,
    tie: float = TIE,
    target: Any = None,
    quiet: bool = False,
) -> Choice:
    """The configuration that fits ``device_budget`` and has the lowest predicted step time.

    Args:
        loss_fn: the loss, as ``ZeroOptimizer.train_step`` takes it.
        params: the parameters (arrays or ``jax.ShapeDtypeStruct`` s); or ``init_fn``.
        batch: the global batch (arrays or ``ShapeDtypeStruct`` s) one step trains on:
            every candidate keeps it, making up smaller micro-batches by accumulation.
        mesh, tx: as for :class:`jzero.ZeroOptimizer`; a mesh of compile-only GPUs
            (:func:`jzero.gpu_mesh`) is planned for as ``target=`` plans.
        config: the run's own options, kept in every candidate (layout, precision, hpZ,
            quantized collectives, the step's options such as ``has_aux``); its stage,
            offload, buckets, prefetch, recompute and accumulation are what is searched.
            Default: ``ZeroConfig(stage=0)``.
        device_budget: bytes of device memory a step may use (default: the device's
            memory, :func:`default_device_budget`).
        host_budget: bytes of pinned host memory an offloaded optimizer may use; None
            (default): offload is not considered. With it, the host optimizer step is
            tried for the whole state and for a share near half (``Offload(ratio=)``, a
            whole number of parameter leaves).
        stages: the stages to consider.
        allow_delay: also try ``Offload(optimizer="host", delay=1)``, ZeRO-Offload's
            delayed parameter update, which applies each gradient one step late after its
            exact warm-up steps: it changes the numbers, so it is tried only when allowed.
        device_model: the rates to predict with (default: :func:`calibrate` on ``mesh``).
        tie: predicted times within this fraction count as equal (the simplest wins).
        target: plan for GPUs that are not here, in place of ``mesh``: a string as
            :func:`jzero.gpu_mesh` takes it, ``"h100:8"`` (8 H100s), ``"h100:64"`` (64 in
            hosts of 8) or ``"h200:8x8"`` (HOSTSxGPUS), or a :func:`jzero.gpu_mesh` (passed
            as ``mesh=``, one plans the same, and ``Choice.notes`` says so). Every candidate
            is compiled by XLA's GPU compiler for them (the ``gpu-compile`` extra); the
            budget is the spec's memory times JAX's allocator share
            (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75) and the rates are datasheet peaks
            (:mod:`jzero.autoconfig.target`), unless given. Offload is not planned there
            (``Choice.notes`` says so).
        quiet: print nothing while searching. Default: its progress on stderr
            (:mod:`jzero.autoconfig.progress`): the devices, the candidates the estimator
            skipped and why, then each candidate as it compiles (i of n, its name, the
            seconds so far), as a bar on a terminal and as lines off one.

    Example (a plan for 64 H100s, from a laptop; nothing the model's size is allocated)::

        choice = jzero.autoconfigure(
            loss_fn, init_fn=functools.partial(model.init, key, x), tx=optax.adamw(3e-4),
            batch={"tokens": jax.ShapeDtypeStruct((512, 2049), jnp.int32)},
            target="h100:64",
        )
        print(choice.summary()); print(choice.table())

    Nothing is run but the device model's probe; every candidate is compiled ahead of time
    on abstract values. Raises ``ValueError`` for a batch whose rows do not split over the
    mesh's data-parallel devices.
    """
    base = ZeroConfig(stage=0) if config is None else config
    with SearchProgress(quiet=quiet) as progress:
        devices = _devices(mesh, target, device_budget, device_model, host_budget, allow_delay)
        for line in (_planning(devices.mesh, devices.budget), *devices.notes):
            progress.say(line)
        problem = _problem(loss_fn, params, init_fn, batch, devices.mesh, tx)
        model = calibrate(devices.mesh) if devices.model is None else devices.model
        search = _Search(problem, base, devices.budget, host_budget, model, progress)
        search.weigh(stages, allow_delay)
        search.variants()
        choice = search.answer(tie, devices)
        progress.done(_finished(choice))
    return choice


class _Devices(NamedTuple):
    """What the search compiles for."""

    mesh: Mesh
    budget: float  # bytes of device memory a step may use
    model: DeviceModel | None  # None: calibrate on the mesh
    notes: tuple[str, ...]  # what the search does differently for them, and why
    compile_only: bool  # GPUs that are not here


def _devices(mesh, target, budget, model, host_budget, allow_delay) -> _Devices:
    """The devices of ``mesh=`` or ``target=``; a mesh of compile-only GPUs is planned for
    as a target, and the notes say so."""
    if mesh is not None and target is not None:
        raise ValueError(f"autoconfigure got mesh= and target=; {_MESH_OR_TARGET}, not both.")
    if target is None and mesh is None:
        raise TypeError(f"autoconfigure needs mesh= or target=; {_MESH_OR_TARGET}.")
    if target is None and not is_compile_only(mesh):
        budget = default_device_budget(mesh) if budget is None else float(budget)
        return _Devices(mesh, budget, model, (), False)
    notes = (OFFLOAD_NOTE,) if target is not None else (COMPILE_ONLY_MESH_NOTE, OFFLOAD_NOTE)
    if host_budget is not None or allow_delay:
        raise ValueError(f"host_budget= and allow_delay= plan offload; {OFFLOAD_NOTE}.")
    mesh, spec = target_mesh(mesh if target is None else target)
    budget = target_budget(spec) if budget is None else float(budget)
    return _Devices(mesh, budget, target_model(spec) if model is None else model, notes, True)


def _finished(choice: Choice) -> str:
    """The search's last line: how long it took, how many it compiled, and the answer."""
    answer = choice.summary().partition("; ")[0]
    return f"{choice.search_seconds:.0f} s, {choice.compiled} compiled; {answer}"


def _planning(mesh: Mesh, budget: float) -> str:
    """The search's first line: the devices and the budget."""
    device = mesh.devices.flat[0]
    hosts = len({d.process_index for d in mesh.devices.flat})
    where = f"{mesh.devices.size} x {device.device_kind}"
    if is_compile_only(mesh):
        where += f" (compile-only, {hosts} host{'s' if hosts > 1 else ''})"
    return f"planning for {where}, a device budget of {_size(budget)} each"


def _size(nbytes: float) -> str:
    """Bytes as the progress lines give them: GB from 1 GB, MB under it."""
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.2f} MB"


def too_large(rows: Sequence[Row], budget: float, mesh: Mesh) -> str:
    """Why nothing was compiled for a target: the model states alone exceed the budget at
    every stage; how many GPUs (whole hosts of 8 above 8) would hold the lightest."""
    lightest = min(r.estimate_bytes for r in rows)
    n = math.prod(mesh.shape.values())
    need = math.ceil(n * lightest / budget)  # the states shrink as 1/N at stage 3
    need = need if need <= GPUS_PER_HOST else -(-need // GPUS_PER_HOST) * GPUS_PER_HOST
    return (
        f"the model's states alone ({lightest / 1e9:,.2f} GB per GPU at best, by the "
        f"estimator) exceed the budget of {budget / 1e9:,.2f} GB on every one of the "
        f"{n} GPUs at every stage; about {need} such GPUs would hold them at stage 3 "
        "(activations need more): plan for more GPUs, a smaller model, or a 16-bit "
        "Precision."
    )


def _problem(loss_fn, params, init_fn, batch, mesh, tx) -> _Problem:
    if (params is None) == (init_fn is None):
        raise ValueError("autoconfigure needs params= or init_fn= (exactly one).")
    shapes = jax.eval_shape(init_fn) if params is None else jax.eval_shape(lambda: params)
    batch = jax.eval_shape(lambda: batch)
    rows = {x.shape[0] for x in jax.tree.leaves(batch) if x.shape}
    if len(rows) != 1:
        raise ValueError(f"the batch's leaves must share one leading (rows) dimension, got {rows}.")
    return _Problem(loss_fn, shapes, batch, mesh, tx, rows.pop())


class _Search:
    """The rows found so far, and how each candidate is compiled and read."""

    def __init__(self, problem: _Problem, base, budget, host_budget, model, progress):
        self.problem, self.base, self.model = problem, base, model
        self.budget, self.host_budget = budget, host_budget
        self.progress: SearchProgress = progress
        self.rows: list[Row] = []
        self.kept: dict[ZeroConfig, tuple[Any, Any]] = {}  # fitting rows' (compiled, state)
        self.compiled = 0
        self.dp = math.prod(
            problem.mesh.shape[a] for a in ("replica", "data") if a in problem.mesh.shape
        )
        self.accums = accumulations(problem.rows, self.dp)

    def can_offload(self) -> bool:
        device = self.problem.mesh.devices.flat[0]
        return "pinned_host" in [m.kind for m in device.addressable_memories()]

    def weigh(self, stages: Sequence[int], allow_delay: bool) -> None:
        """Rows for every shape of ``stages``: those whose model states the estimator puts
        over the budget, said in one line; the others compiled (:meth:`shape`)."""
        offload = self.host_budget is not None and self.can_offload()
        sizes = [math.prod(x.shape) for x in jax.tree.leaves(self.problem.shapes)]
        kinds = dict(offload=offload, partial=partial_share(sizes), delay=allow_delay)
        found = list(shapes(self.base, stages=stages, **kinds))
        states = {s: self._estimate(self._config(s, 1, False, False)) for s in found}
        over = [s for s in found if states[s] > self.budget]
        self.progress.say(_skipped(over, states, self.budget))
        self.progress.plan(len(found) - len(over))
        for shape in found:
            self.shape(shape, states[shape])

    def shape(self, shape: Shape, states: float) -> None:
        """Rows for ``shape`` (``states``: its model states by the estimator): dropped by
        the estimate, or its accumulations compiled from the smallest until one fits (the
        larger ones are not compiled: slower)."""
        if states > self.budget:
            why = f"model states {states / 1e6:,.2f} MB > budget (estimate)"
            self.rows += [
                self._row(self._config(shape, k, False, False), states, why=why)
                for k in self.accums
            ]
            return
        for i, k in enumerate(self.accums):
            row = self._measure(self._config(shape, k, False, False), states)
            self.rows.append(row)
            if row.fits:
                skipped = "not compiled: a smaller accumulation fits"
                self.rows += [
                    self._row(self._config(shape, j, False, False), states, why=skipped)
                    for j in self.accums[i + 1 :]
                ]
                return

    def variants(self, top: int = 3) -> None:
        """Buckets and prefetch for the ``top`` fastest fitting rows."""
        best = sorted((r for r in self.rows if r.fits), key=lambda r: r.seconds)[:top]
        found = [
            (self._config(Shape.of(r.config), r.config.step.grad_accum, bucket, prefetch), r)
            for r in best
            for bucket, prefetch in collective_variants(self.base, r.config.stage)
        ]
        self.progress.plan(len(found))
        for config, row in found:
            self.rows.append(self._measure(config, row.estimate_bytes))

    def answer(self, tie: float, devices: _Devices) -> Choice:
        """The choice (:meth:`choose`), or when nothing fits the lightest candidate
        (:meth:`smallest`); for GPUs that are not here where nothing could be compiled,
        refused (:func:`too_large`) before compiling the lightest."""
        chosen, larger = self.choose(tie)
        if devices.compile_only and chosen is None and self.compiled == 0:
            raise ValueError(too_large(self.rows, self.budget, devices.mesh))
        smallest = None if chosen is not None else self.smallest()
        return Choice(
            config=None if chosen is None else chosen.config,
            rows=tuple(self.rows),
            device_budget=self.budget,
            host_budget=self.host_budget,
            device_model=self.model,
            search_seconds=self.progress.seconds(),
            compiled=self.compiled,
            smallest=smallest,
            notes=devices.notes,
            larger=larger,
            chosen_step=None if chosen is None else ChosenStep(*self.kept[chosen.config]),
        )

    def choose(self, tie: float) -> tuple[Row | None, Row | None]:
        """The row :func:`select` picks, and its configuration at the next-larger
        micro-batch, compiled (so the answer shows the micro-batch is the largest that
        fits; should that one fit after all, as a variant's might, it joins the rows and
        the choice is made again)."""
        chosen = select(self.rows, tie=tie)
        while chosen is not None:
            larger = self.larger(chosen)
            again = select(self.rows, tie=tie)
            if again is chosen:
                return chosen, larger
            chosen = again
        return None, None

    def larger(self, row: Row) -> Row | None:
        """``row``'s configuration with the next fewer micro-batches, as compiled (None
        when ``row`` already takes each device's rows at once)."""
        fewer = [k for k in self.accums if k < row.config.step.grad_accum]
        if not fewer:
            return None
        step = dataclasses.replace(row.config.step, grad_accum=fewer[-1])
        config = dataclasses.replace(row.config, step=step)
        found = [r for r in self.rows if r.config == config and r.device_bytes is not None]
        if found:
            return found[0]
        self.rows = [r for r in self.rows if r.config != config]
        self.rows.append(self._measure(config, row.estimate_bytes))
        return self.rows[-1]

    def smallest(self) -> Row | None:
        """The lightest compiled candidate, after compiling every accumulation of the
        stage-3 shapes not compiled yet (recompute, and offload when allowed: the lightest
        there are; more micro-batches need not be lighter, their accumulators weigh)."""
        offload = self.host_budget is not None and self.can_offload()
        for shape in shapes(self.base, stages=(3,), offload=offload):
            for k in self.accums:
                config = self._config(shape, k, False, False)
                if not any(r.config == config and r.device_bytes is not None for r in self.rows):
                    self.rows = [r for r in self.rows if r.config != config]
                    self.rows.append(self._measure(config, self._estimate(config)))
        compiled = [r for r in self.rows if r.device_bytes is not None]
        return min(compiled, key=lambda r: r.device_bytes, default=None)

    def _config(self, shape: Shape, accum: int, bucket: bool, prefetch: bool) -> ZeroConfig:
        return shape.config(self.base, accum=accum, bucket=bucket, prefetch=prefetch)

    def _estimate(self, config: ZeroConfig) -> float:
        """Model-state bytes per device by the estimator, with ``tx``'s own bytes/param."""
        p = self.problem
        psi = sum(math.prod(x.shape) for x in jax.tree.leaves(p.shapes))
        opt = jax.eval_shape(p.tx.init, config.precision.cast(p.shapes, "float32"))
        opt_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt))
        mixed = config.precision.mixed
        k = opt_bytes / max(psi, 1) + (4 if mixed else 0)
        offload, n = config.offload, p.mesh.shape["data"]
        est = estimate(
            params=psi,
            devices=n,
            stage=config.stage,
            k=k,
            precision="mixed" if mixed else "fp32",
            offload=offload.optimizer,
            offload_ratio=offload.ratio if offload.optimizer else 1.0,
        )
        return est.model_state_bytes

    def _row(self, config: ZeroConfig, states: float, *, why: str, **measured) -> Row:
        mb = micro_batch(self.problem.rows, self.dp, config.step.grad_accum)
        unmeasured = ("device_bytes", "host_bytes", "collective_bytes", "collectives", "flops")
        fields = dict.fromkeys((*unmeasured, "seconds")) | measured
        return Row(describe(config), config, mb, states, dropped=why, **fields)

    def _measure(self, config: ZeroConfig, states: float) -> Row:
        """Compiles ``config``'s step ahead of time and reads it."""
        self.progress.compiling(describe(config))
        p, start = self.problem, time.perf_counter()
        opt = ZeroOptimizer(p.tx, p.mesh, config=config)
        init = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), p.shapes)
        program, arg = opt.init_program(init_fn=init)
        state = jax.eval_shape(program, arg)
        try:
            compiled = opt.train_step(p.loss_fn).lower(state, p.batch).compile()
        except Exception as e:  # noqa: BLE001 -- a candidate the compiler refuses is a row
            return self._row(config, states, why=f"does not compile: {type(e).__name__}: {e}"[:120])
        self.compiled += 1
        took = time.perf_counter() - start
        text = compiled.as_text()
        peak = memory_spaces.of_compiled(compiled, hlo_text=text)
        found = collectives(text)
        comm, flops, count = comm_bytes(found)["total"], dot_flops(text), launches(found)
        copies, updates = _host_bytes(state.plan)
        seconds = self.model.step_seconds(
            flops, comm, copies, updates, collectives=count, overlapped=bool(config.offload.delay)
        )
        device, host = peak["device"], peak["pinned_host"]
        why = None
        if device > self.budget:
            why = f"compiled peak {device / 1e6:,.2f} MB > budget"
        elif host and (self.host_budget is None or host > self.host_budget):
            why = f"host peak {host / 1e6:,.2f} MB > host budget"
        if why is None:
            self.kept[config] = (compiled, state)
        return Row(
            describe(config),
            config,
            micro_batch(p.rows, self.dp, config.step.grad_accum),
            states,
            device,
            host,
            comm,
            count,
            flops,
            seconds,
            why,
            took,
        )


def _skipped(over: list[Shape], states: dict[Shape, float], budget: float) -> str:
    """The line that names the shapes the estimator skipped, and why."""
    if not over:
        return (
            f"none skipped: by the estimate, every shape's model states fit the "
            f"{_size(budget)} budget"
        )
    each = ", ".join(f"{shape_name(s)} ({_size(states[s])})" for s in over)
    return (
        f"skipped without compiling, their model states over the {_size(budget)} budget by "
        f"the estimate: {each}"
    )


def _host_bytes(plan: Plan) -> tuple[float, float]:
    """Per device and step, with the optimizer step on the host: the bytes copied between
    device and host (reduced gradient shards down, in the reduce dtype; new parameter
    shards up) and the bytes the host update reads and writes (its state and master
    weights, twice; the gradients once), of the parameter leaves whose state rests on the
    host (``Offload.ratio``'s share). (0, 0) otherwise."""
    offload = plan.config.offload
    if offload.optimizer != "host":
        return 0.0, 0.0
    n = plan.data_size
    reduce = np.dtype(plan.config.precision.reduce_dtype).itemsize
    shard = lambda s: math.prod(s.shape) / (n if s.partitioned else 1)
    hosted = [s for s, on in zip(plan.params, plan.offloaded) if on]
    grads = sum(shard(s) * reduce for s in hosted)
    params = sum(shard(s) * s.dtype.itemsize for s in hosted)
    on_host = [s for s in plan.opt + (plan.master or ()) if s.memory_kind is not None]
    state = sum(shard(s) * s.dtype.itemsize for s in on_host)
    return grads + params, 2 * state + grads
