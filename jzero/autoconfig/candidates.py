"""The configurations the search weighs, and the micro-batch arithmetic behind them.

A candidate is a :class:`jzero.ZeroConfig` -- a stage, an offload (none, or the optimizer
step on the host for the whole state or, ZeRO-Offload++'s partial offload, about half of
it; with ``delay`` allowed, ZeRO-Offload's delayed update too), per-layer recompute or not,
buckets and prefetch on or off, a gradient accumulation -- derived from the user's own
(their layout, precision and step options stay). Gradient accumulation makes up the
global batch: ``rows = micro x accum x devices``, so every candidate trains on the same
global batch, with the same numerics as single-device Optax on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax

from ..core.options.offload import Offload, offloaded_leaves
from ..core.options.zero_config import ZeroConfig

RECOMPUTE = jax.checkpoint_policies.nothing_saveable
"""Stage 3's per-layer recompute: keep each layer's input only, recompute the rest."""


def accumulations(rows: int, dp: int) -> tuple[int, ...]:
    """Every gradient accumulation that splits a global batch of ``rows`` over ``dp``
    data-parallel devices into whole micro-batches, smallest first (1: no accumulation)."""
    if rows < 1 or dp < 1 or rows % dp:
        raise ValueError(
            f"a global batch of {rows} rows does not split over {dp} data-parallel devices; "
            f"use a multiple of {dp} rows."
        )
    per_device = rows // dp
    return tuple(k for k in range(1, per_device + 1) if per_device % k == 0)


def micro_batch(rows: int, dp: int, accum: int) -> int:
    """Rows per device in one micro-batch: ``rows / (dp x accum)``."""
    if rows % (dp * accum):
        raise ValueError(f"{rows} rows do not split into {accum} micro-batches on {dp} devices.")
    return rows // (dp * accum)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a candidate is, apart from its accumulation (a group compiled together)."""

    stage: int
    host: float  # the share of the optimizer state updated on the host (0: none)
    recompute: bool  # stage 3: per-layer recompute
    delay: bool = False  # ZeRO-Offload's delayed parameter update (Offload(delay=1))

    @classmethod
    def of(cls, config: ZeroConfig) -> Shape:
        """The shape of a candidate's configuration."""
        offload = config.offload
        host = offload.ratio if offload.optimizer == "host" else 0.0
        recompute = config.step.remat_policy is RECOMPUTE
        return cls(config.stage, host, recompute, bool(offload.delay))

    def config(self, base: ZeroConfig, *, accum: int, bucket: bool, prefetch: bool):
        """``base`` with this shape's stage, offload and recompute, and these collectives."""
        comm = dataclasses.replace(base.comm, bucket=bucket, prefetch=prefetch)
        offload = Offload()
        if self.host:
            offload = Offload(optimizer="host", ratio=self.host, delay=int(self.delay))
        policy = RECOMPUTE if self.recompute else base.step.remat_policy
        step = dataclasses.replace(base.step, grad_accum=accum, remat_policy=policy)
        return ZeroConfig(
            stage=self.stage,
            layout=base.layout,
            precision=base.precision,
            comm=comm,
            offload=offload,
            step=step,
        )


def shapes(
    base: ZeroConfig, *, stages, offload: bool, partial: float | None = None, delay: bool = False
) -> Iterator[Shape]:
    """Every shape worth compiling: each stage, with and without the host optimizer step
    (stages 1-3, when ``offload``: the whole state, and the ``partial`` share, a leaf
    boundary near half, when there is one; with ``delay``, the whole state's delayed update
    too), stage 3 with and without per-layer recompute (when its default gathering runs:
    not with ``manual_gather``)."""
    recompute = not base.step.manual_gather
    hosts = [(0.0, False)]
    if offload:
        hosts += [(partial, False)] if partial else []
        hosts += [(1.0, False)] + ([(1.0, True)] if delay else [])
    for stage in stages:
        for host, late in hosts if stage >= 1 else hosts[:1]:
            for again in (False, True) if stage == 3 and recompute else (False,):
                yield Shape(stage, host, again, late)


def partial_share(sizes: list[int], near: float = 0.5) -> float | None:
    """The share of the parameters a partial offload near ``near`` updates on the host: a
    whole number of leaves (``Offload.ratio`` at it splits exactly there); None when no
    split lies strictly between none and all."""
    chosen = offloaded_leaves(sizes, near)
    share = sum(n for n, on in zip(sizes, chosen) if on) / max(sum(sizes), 1)
    return share if 0 < share < 1 else None


def collective_variants(base: ZeroConfig, stage: int) -> tuple[tuple[bool, bool], ...]:
    """``(bucket, prefetch)`` pairs worth trying at ``stage`` beyond (False, False): buckets
    from stage 2 (flat reduce-scatters; stage 3 flat gathers too), prefetch at stage 3
    with the default gathering. hpZ does not prefetch."""
    pairs = [(True, False)] if stage >= 2 else []
    if stage == 3 and not base.step.manual_gather and base.comm.hpz is None:
        pairs += [(False, True), (True, True)]
    return tuple(pairs)


def shape_name(shape: Shape) -> str:
    """A shape's short name, its candidates' without the accumulation, e.g. ``zero3 host
    recompute``."""
    config = shape.config(ZeroConfig(stage=shape.stage), accum=1, bucket=False, prefetch=False)
    return describe(config).removesuffix(" accum=1")


def describe(config: ZeroConfig) -> str:
    """A candidate's short name, e.g. ``zero3 host recompute bucket prefetch accum=4``."""
    parts = [f"zero{config.stage}"]
    offload = config.offload
    if offload.optimizer == "host":
        parts += ["host" if offload.ratio == 1 else f"host{offload.ratio:.2f}"]
        parts += ["delay"] if offload.delay else []
    parts += ["recompute"] if config.step.remat_policy is RECOMPUTE else []
    parts += ["bucket"] if config.comm.bucket else []
    parts += ["prefetch"] if config.comm.prefetch else []
    return " ".join(parts + [f"accum={config.step.grad_accum}"])
