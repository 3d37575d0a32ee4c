"""``jzero.from_deepspeed_config``: a DeepSpeed JSON config read into jzero's options.

Every key is looked up in a table (this module's ``TOP``; the ZeRO section's, the
optimizer's, the schedulers' and precision's in their modules): honoured keys become options,
keys that change nothing in jzero are listed in one :class:`DeepSpeedConfigWarning` with
why, and unknown keys or keys jzero cannot honour (offloading to NVMe or offloading
parameters, Lamb, a fixed loss scale...) raise a ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import optax
from jax.sharding import Mesh

from ..core.optimizer import ZeroOptimizer
from ..core.plan import Stage
from ..core.precision import Precision
from .keys import Key, Section, no_effect, number, positive
from .optim import OPTIMIZER, read_optimizer
from .precision import COMMUNICATION, read_precision
from .schedules import SCHEDULER, schedule_from
from .zero import read_zero


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed keys that jzero accepts but that change nothing, each with why."""


LOGGING = no_effect("DeepSpeed's logging and monitoring; jzero.report shows memory and traffic")
TOP = {
    "train_batch_size": Key(positive),
    "train_micro_batch_size_per_gpu": Key(positive),
    "gradient_accumulation_steps": Key(positive),
    "gradient_clipping": Key(number, 0.0),
    "optimizer": Key(),
    "scheduler": Key(),
    "zero_optimization": Key(default={}),
    "fp16": Key(default={}),
    "bf16": Key(default={}),
    "bfloat16": Key(default={}),  # DeepSpeed's older name for "bf16"
    "communication_data_type": COMMUNICATION,
    "prescale_gradients": Key(
        default=False, no_effect="jzero divides after reducing", matches=(False,)
    ),
    "gradient_predivide_factor": Key(
        default=1.0, no_effect="jzero divides after reducing", matches=(1.0,)
    ),
    "zero_allow_untested_optimizer": no_effect("jzero runs any Optax transformation"),
    "zero_force_ds_cpu_optimizer": no_effect(
        "jzero has no CPU optimizer: an offloaded optimizer state is updated on the accelerator"
    ),
    "activation_checkpointing": no_effect(
        "jzero leaves the model as it is; use jax.checkpoint or jzero.remat_layer in it"
    ),
    "checkpoint": no_effect("jzero.Checkpointer writes and restores checkpoints"),
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "memory_breakdown"), LOGGING),
    **dict.fromkeys(("dump_state", "flops_profiler", "tensorboard", "wandb"), LOGGING),
    **dict.fromkeys(("csv_monitor", "comms_logger"), LOGGING),
}


class BatchSizes(NamedTuple):
    """The config's batch sizes on a given number of data-parallel devices."""

    train_batch_size: int  # samples per update, over every device: jzero's global batch
    micro_batch_size: int  # samples per device in one micro-batch
    grad_accum: int  # micro-batches per update: train_step(..., grad_accum=)


def clipped(max_norm: float, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` after global-norm clipping to ``max_norm`` (0: no clipping, as DeepSpeed)."""
    return optax.chain(optax.clip_by_global_norm(max_norm), tx) if max_norm > 0 else tx


@dataclasses.dataclass(frozen=True)
class DeepSpeedOptions:
    """A DeepSpeed config as jzero's options (:func:`from_deepspeed_config`).

    Attributes:
        stage: ``zero_optimization.stage`` (DeepSpeed's default 0).
        precision: from ``fp16`` / ``bf16`` / ``communication_data_type``, with
            ``gather_quant="int8"`` for ``zero_quantized_weights`` and ``grad_quant="int8"``
            for ``zero_quantized_gradients`` (ZeRO++ qwZ and qgZ).
        offload: ``"optimizer"`` for ``offload_optimizer`` ``{"device": "cpu"}`` (or
            ``cpu_offload``): the optimizer state and fp32 master weights rest in pinned host
            memory (``ZeroOptimizer(offload=...)``); None otherwise.
        offload_chunk: with ``offload``, ``sub_group_size``: the most elements of a leaf
            whose state streams through the device at once (``ZeroOptimizer(offload_chunk=
            ...)``); None: absent (jzero's default) or not offloaded.
        tx: the ``optimizer`` with its ``scheduler``, after ``gradient_clipping``; None
            without an ``optimizer``.
        learning_rate: the ``scheduler`` as an Optax schedule, else the optimizer's lr;
            None with neither. Use it to build your own tx when the config has no optimizer.
        gradient_clipping: the global-norm bound (0: none).
        min_shard_size: ``stage3_param_persistence_threshold`` + 1 at stage 3: leaves of at
            most that many elements stay replicated. Unlike DeepSpeed, which partitions their
            gradients and optimizer state anyway, jzero replicates those too. None: absent.
        train_batch_size, micro_batch_size, grad_accum: ``train_batch_size``,
            ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` as written
            (None when absent); :meth:`batch_sizes` completes and checks them.
    """

    stage: Stage
    precision: Precision
    offload: Literal["optimizer"] | None
    tx: optax.GradientTransformation | None
    learning_rate: optax.ScalarOrSchedule | None
    gradient_clipping: float
    min_shard_size: int | None
    train_batch_size: int | None
    micro_batch_size: int | None
    grad_accum: int | None
    offload_chunk: int | None = None

    def batch_sizes(self, *, data_parallel_size: int) -> BatchSizes:
        """The three batch sizes on ``data_parallel_size`` devices, completed as DeepSpeed
        does; raises when they disagree (train = micro x accumulation x devices)."""
        n, train, micro, k = (
            data_parallel_size,
            self.train_batch_size,
            self.micro_batch_size,
            self.grad_accum,
        )
        if train is None and micro is None:
            raise ValueError(
                "DeepSpeed config: give train_batch_size or train_micro_batch_size_per_gpu "
                "(DeepSpeed needs one of them too)."
            )
        if train is None or micro is None:
            k = k or 1
            train = micro * k * n if train is None else train
            micro = train // (k * n) if micro is None else micro
        k = train // (micro * n) if k is None else k
        if k < 1 or micro < 1 or train != micro * k * n:
            names = ("train_batch_size", "train_micro_batch_size_per_gpu")
            names += ("gradient_accumulation_steps",)
            written = (self.train_batch_size, self.micro_batch_size, self.grad_accum)
            given = ", ".join(f"{a} {b}" for a, b in zip(names, written) if b is not None)
            raise ValueError(
                f"DeepSpeed config: {given} on {n} data-parallel device{'s' * (n > 1)}: "
                "train_batch_size must be train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x {n}. Change one of them."
            )
        return BatchSizes(train, micro, k)

    def optimizer(
        self,
        mesh: Mesh,
        *,
        tx: optax.GradientTransformation | None = None,
        param_specs: Any = None,
    ) -> ZeroOptimizer:
        """A :class:`jzero.ZeroOptimizer` with the config's stage, precision, offload and
        ``min_shard_size``, around ``self.tx``, or around ``tx`` (after the config's
        clipping) when the config has no ``optimizer``."""
        if (tx is None) == (self.tx is None):
            raise ValueError(
                'the DeepSpeed config has an "optimizer": call optimizer(mesh) without tx.'
                if tx is not None
                else 'the DeepSpeed config has no "optimizer": pass optimizer(mesh, tx=...).'
            )
        tx = self.tx if tx is None else clipped(self.gradient_clipping, tx)
        extra = {} if self.min_shard_size is None else {"min_shard_size": self.min_shard_size}
        if self.offload_chunk is not None:
            extra["offload_chunk"] = self.offload_chunk
        return ZeroOptimizer(
            tx,
            mesh,
            stage=self.stage,
            precision=self.precision,
            offload=self.offload,
            param_specs=param_specs,
            **extra,
        )


def from_deepspeed_config(config: str | os.PathLike | Mapping[str, Any]) -> DeepSpeedOptions:
    """Reads a DeepSpeed JSON config (a path, or the parsed dict) into jzero's options.

    Warns once (:class:`DeepSpeedConfigWarning`) listing the keys that change nothing in
    jzero, with why; raises ``ValueError`` naming any unknown key or one jzero cannot honour.

    Examples:
        >>> ds = jzero.from_deepspeed_config("examples/deepspeed/zero2_fp16.json")
        >>> opt = ds.optimizer(jzero.data_mesh())
        >>> k = ds.batch_sizes(data_parallel_size=opt.data_size * opt.replica_size).grad_accum
        >>> train_step = opt.train_step(loss_fn, grad_accum=k)
    """
    if not isinstance(config, Mapping):
        path = pathlib.Path(config)
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {path} is not valid JSON: {e}.") from None
    notes: list[str] = []
    top = Section(config, path="", table=TOP, notes=notes)
    precision = read_precision(top)
    zero = read_zero(top)
    # ZeRO++ qwZ and qgZ: int8 all-gathers and gradient reduce-scatters, blockwise scales.
    precision = dataclasses.replace(
        precision, gather_quant=zero.gather_quant, grad_quant=zero.grad_quant
    )
    clip = top["gradient_clipping"]
    if clip < 0:
        top.refuse("gradient_clipping", "use a positive bound, or 0 for none.")
    optimizer = read_optimizer(top.section("optimizer", OPTIMIZER)) if "optimizer" in top else None
    learning_rate = None if optimizer is None else optimizer.lr
    if "scheduler" in top:
        learning_rate = schedule_from(
            top.section("scheduler", SCHEDULER),
            base_lr=learning_rate,
            betas=True if optimizer is None else optimizer.betas,
        )
    if notes:
        lines = "\n  ".join(notes)
        warnings.warn(
            DeepSpeedConfigWarning(f"DeepSpeed keys with no effect in jzero:\n  {lines}"),
            stacklevel=2,
        )
    return DeepSpeedOptions(
        stage=zero.stage,
        precision=precision,
        offload=zero.offload,
        offload_chunk=zero.offload_chunk,
        tx=None if optimizer is None else clipped(clip, optimizer.tx(learning_rate)),
        learning_rate=learning_rate,
        gradient_clipping=clip,
        min_shard_size=zero.min_shard_size,
        train_batch_size=top["train_batch_size"],
        micro_batch_size=top["train_micro_batch_size_per_gpu"],
        grad_accum=top["gradient_accumulation_steps"],
    )
