"""How the step communicates: quantized collectives, buckets, prefetch.

These choices change what travels between devices and when, not the dtype the model
computes in (that is :class:`jzero.Precision`). They are given once, to the optimizer
(``ZeroOptimizer(..., comm=jzero.Communication(...))``), which checks them against its
stage when it is built.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from .moved import names_moved_options

GATHER_QUANTS = ("int8", "fp8")
"""The values ``Communication.gather_quant`` accepts besides None."""
GRAD_QUANTS = ("int8", "int4")
"""The values ``Communication.grad_quant`` accepts besides None."""


@dataclasses.dataclass(frozen=True)
class Quant:
    """How a parameter all-gather is quantized (static: hashable, part of the trace).

    Attributes:
        dtype: the wire dtype of the values: ``'int8'``, ``'fp8'`` (float8_e4m3fn,
            gathers only) or ``'int4'`` (gradients only).
        block: at most this many consecutive elements share one fp32 scale.
    """

    dtype: Literal["int8", "int4", "fp8"] = "int8"
    block: int = 256


@names_moved_options
@dataclasses.dataclass(frozen=True)
class Communication:
    """The collectives a ZeRO step runs, beyond their defaults.

    Attributes:
        gather_quant: ``'int8'``: stage 3 all-gathers its parameters as int8 with one fp32
            scale per block of ``quant_block`` elements (ZeRO++'s qwZ, about 0.254x fp32's
            bytes, 0.508x bf16's; :mod:`jzero.core.comm.quantize`); each element is off by
            at most absmax/254 of its block. ``'fp8'``: the same bytes, as float8_e4m3fn
            with ``scale = absmax / 448`` per block; each element is off by at most
            ``max(|x| / 16, absmax / 458752)`` (e4m3's 3 mantissa bits: a relative error,
            lower than int8's where a block holds outliers, about 4x higher on Gaussian
            weights). Gradients are those at the dequantized parameters, reduce-scattered
            unquantized. None: gathered exactly. Only stage 3 gathers parameters.
        grad_quant: ``'int8'`` or ``'int4'``: stages 1-3 reduce-scatter their gradients
            quantized (ZeRO++'s qgZ): each device quantizes the part of its gradient each
            other device owns, with one fp32 scale per block of ``quant_block`` elements,
            sends it in one all-to-all, and the owner dequantizes and sums the N parts in
            fp32. Each device's contribution is off by at most absmax/254 (int8) or
            absmax/14 (int4) of its block. None: reduced exactly in the precision's
            ``reduce_dtype``. Stage 0 (all-reduce) has no reduce-scatter to quantize.
        quant_block: elements per fp32 scale of a quantized gather or reduce-scatter (a
            positive int; even for ``grad_quant='int4'``, which packs two values a byte).
        bucket: each layer's leaves travel as one flat all-gather (stage 3) and one flat
            reduce-scatter (stages 2/3) per dtype instead of one collective per leaf
            (DeepSpeed's buckets, FSDP2's parameter groups; :mod:`jzero.core.comm.buckets`).
            A layer is what one gather happens for: a scan step (each ``jax.checkpoint``
            in it where the step's body has them, as ``nn.remat`` layers do), a
            :func:`jzero.remat_layer`, a ``layers=`` block, a ``jzero.gather`` call.
            Exact (bitwise the collectives of ``bucket=False``).
        prefetch: stage 3's default gathering, in scans over stacked layers: issue layer
            i+1's all-gather in the step that computes layer i, and in backward layer
            i-1's in the step of layer i (FSDP2's forward/backward prefetch, for XLA's
            latency-hiding scheduler on GPU; :mod:`jzero.core.gather.prefetch`). Two
            layers are gathered at a time instead of one. Same values as without.
        hpz: ZeRO++'s hpZ (FSDP2's ``reshard_after_forward=G``), a secondary partition
            size G: after forward each stage-3 parameter stays gathered over groups of G
            consecutive data-axis devices (a node), so backward's all-gather stays inside
            the group. Each gather becomes an all-gather across the N/G groups (forward
            only; the quantized one with ``gather_quant``) and one within the group
            (forward and backward): across the groups a step gathers the parameters once
            instead of twice, for ``+Psi * bytes / G`` memory per device (the secondary
            copies kept from forward to backward; :mod:`jzero.core.comm.hpz`). An int,
            ``1 < G < N`` dividing the data axis size N; stage 3 only. Same values as
            without. None: off.
        pipeline_scatter: on GPUs, let XLA's collective pipeliner move each loop step's
            gradient reduce-scatters into the next step, where they overlap that step's
            backward (XLA:GPU's default, ``xla_gpu_pipeline_reduce_scatter``): one
            layer's full gradients then stay alive from one step into the next, which at
            stages 2-3 is the memory ZeRO exists to free. False (the default): jzero's step
            is compiled with the pipeliner off, each reduce-scatter done in its own step
            (:mod:`jzero.core.compile_options`). Stages 1-3; same values either way.

    Examples:
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=3,
        ...                           comm=jzero.Communication(gather_quant='int8'))
    """

    gather_quant: Literal["int8", "fp8"] | None = None
    grad_quant: Literal["int8", "int4"] | None = None
    quant_block: int = 256
    bucket: bool = False
    prefetch: bool = False
    hpz: int | None = None
    pipeline_scatter: bool = False

    def __post_init__(self):
        quant = self.gather_quant  # a str: a dtype such as np.dtype('int8') equals 'int8'
        if quant is not None and (not isinstance(quant, str) or quant not in GATHER_QUANTS):
            raise ValueError(
                "Communication.gather_quant must be None, 'int8' or 'fp8' (float8_e4m3fn), "
                f"got {self.gather_quant!r}; e.g. Communication(gather_quant='fp8')."
            )
        if self.grad_quant is not None and self.grad_quant not in GRAD_QUANTS:
            allowed = " or ".join(repr(q) for q in GRAD_QUANTS)
            raise ValueError(
                f"Communication.grad_quant must be None or {allowed}, got "
                f"{self.grad_quant!r}; e.g. Communication(grad_quant='int8')."
            )
        object.__setattr__(self, "quant_block", _check_block(self.quant_block, self.grad_quant))
        for name in ("bucket", "prefetch", "pipeline_scatter"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"Communication.{name} must be True or False, got {getattr(self, name)!r}."
                )

        if self.hpz is not None and (
            isinstance(self.hpz, bool) or not isinstance(self.hpz, int | np.integer) or self.hpz < 2
        ):
            raise ValueError(
                f"Communication.hpz must be None or an int >= 2 (the secondary partition "
                f"size: devices per group, e.g. one node's), got {self.hpz!r}; e.g. "
                "Communication(hpz=8) for 8 devices per node, or hpz=None to gather over "
                "the whole data axis."
            )
        if self.hpz is not None:
            object.__setattr__(self, "hpz", int(self.hpz))

    @property
    def gather_quantizer(self) -> Quant | None:
        """How stage 3's parameter all-gathers are quantized; None: they are exact."""
        return None if self.gather_quant is None else Quant(self.gather_quant, self.quant_block)

    @property
    def grad_quantizer(self) -> Quant | None:
        """How gradient reduce-scatters are quantized; None: they are exact."""
        return None if self.grad_quant is None else Quant(self.grad_quant, self.quant_block)

    def check_stage(self, stage: int) -> None:
        """Raises where a choice has nothing to act on at ``stage`` (checked when the
        optimizer is built, before anything is traced)."""
        if self.gather_quant is not None and stage != 3:
            raise ValueError(
                f"Communication(gather_quant={self.gather_quant!r}) quantizes stage 3's "
                f"parameter all-gathers, but stage {stage} gathers no parameters; use "
                "stage=3, or leave gather_quant=None."
            )
        if self.grad_quant is not None and stage == 0:
            raise ValueError(
                f"Communication(grad_quant={self.grad_quant!r}) quantizes the gradient "
                "reduce-scatters of stages 1-3, but stage 0 all-reduces its gradients; use "
                "stage=1, 2 or 3, or leave grad_quant=None."
            )
        if self.prefetch and stage != 3:
            raise ValueError(
                f"Communication(prefetch=True) issues stage 3's next parameter all-gather "
                f"early, but stage {stage} gathers no parameters; use stage=3, or leave "
                "prefetch=False."
            )
        if self.pipeline_scatter and stage == 0:
            raise ValueError(
                "Communication(pipeline_scatter=True) pipelines the gradient "
                "reduce-scatters of stages 1-3, but stage 0 all-reduces its gradients; use "
                "stage=1, 2 or 3, or leave pipeline_scatter=False."
            )
        if self.hpz is not None and stage != 3:
            raise ValueError(
                f"Communication(hpz={self.hpz}) keeps stage 3's gathered parameters over "
                f"groups of {self.hpz} devices between forward and backward, but stage "
                f"{stage} gathers no parameters; use stage=3, or leave hpz=None."
            )
        if self.hpz is not None and self.prefetch:
            raise ValueError(
                f"Communication(hpz={self.hpz}, prefetch=True): prefetching scans do not "
                "keep hpZ's secondary copies yet; use one of them (hpz=None or "
                "prefetch=False)."
            )

    def check_data_size(self, n: int) -> None:
        """Raises where ``hpz`` does not cut a data axis of ``n`` devices into groups
        (checked when the optimizer is built)."""
        if self.hpz is None or (n % self.hpz == 0 and self.hpz < n):
            return
        divisors = [g for g in range(2, n) if n % g == 0]
        fix = f"one of {divisors}" if divisors else "None (no group size fits)"
        raise ValueError(
            f"Communication(hpz={self.hpz}) needs groups of {self.hpz} devices that divide "
            f"the data axis of {n} into more than one group; use hpz={fix}, e.g. the "
            "devices of one node."
        )


def _check_block(block: object, grad_quant: str | None) -> int:
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(
            f"Communication.quant_block must be a positive int (elements per fp32 scale), "
            f"got {block!r}; e.g. Communication(gather_quant='int8', quant_block=256)."
        )
    if grad_quant == "int4" and block % 2:
        raise ValueError(
            f"Communication.quant_block must be even with grad_quant='int4' (two 4-bit "
            f"values share a byte), got {block}; e.g. quant_block=256."
        )
    return int(block)
