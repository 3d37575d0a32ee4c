"""``jzero.from_deepspeed_config``: a DeepSpeed JSON config read into jzero's options.

Every key is looked up in a table (this module's ``TOP``; the ZeRO section's, the
optimizer's, the schedulers' and precision's in their modules): honoured keys become options,
keys that change nothing in jzero are listed in one ``DeepSpeedConfigWarning`` with
why, and every key jzero cannot use -- unknown, of the wrong type, given twice, the Hugging
Face Trainer's ``"auto"``, or one jzero cannot honour (offloading to NVMe or offloading
parameters, Lamb, a fixed loss scale...) -- is listed, with why and the fix, in one
``DeepSpeedConfigError`` once the whole config is read (:mod:`jzero.config.findings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import optax
from jax.sharding import Mesh

from ..core.options.communication import Communication
from ..core.options.layout import Layout
from ..core.options.offload import Offload
from ..core.options.precision import Precision
from ..core.options.step import StepOptions
from ..core.options.zero_config import Stage, ZeroConfig
from ..optimizers.zero_optimizer import ZeroOptimizer
from .auto import fill_auto
from .findings import Findings
from .fp16_bf16 import COMMUNICATION, read_precision
from .jsonc import parse as parse_jsonc
from .keys import Key, Section, attempt, no_effect, number, positive
from .optim import read_optimizer
from .schedules import read_schedule
from .zero import read_zero

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
        "with offload_optimizer on the CPU jzero runs any Optax update on the host"
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
        precision: from ``fp16`` / ``bf16`` / ``communication_data_type``.
        comm: a :class:`jzero.Communication` with ``gather_quant="int8"`` for
            ``zero_quantized_weights`` and ``grad_quant="int8"`` for
            ``zero_quantized_gradients`` (ZeRO++ qwZ and qgZ), and ``hpz`` for
            ``zero_hpz_partition_size`` above 1 (ZeRO++ hpZ; the size must divide the mesh's
            data axis, checked by :meth:`optimizer`).
        offload: the :class:`jzero.Offload` for ``offload_optimizer`` ``{"device": "cpu"}``
            (or ``cpu_offload``): ``Offload(optimizer="host")``, the optimizer state and
            fp32 master weights rest in pinned host memory and are updated there, as
            DeepSpeed's CPU Adam does. None otherwise.
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
    offload: Offload | None
    tx: optax.GradientTransformation | None
    learning_rate: optax.ScalarOrSchedule | None
    gradient_clipping: float
    min_shard_size: int | None
    train_batch_size: int | None
    micro_batch_size: int | None
    grad_accum: int | None
    comm: Communication = Communication()

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

    def config(self, *, param_specs: Any = None, grad_accum: int = 1) -> ZeroConfig:
        """The run's :class:`jzero.ZeroConfig`: the config's stage, precision, comm, offload
        and ``min_shard_size``, with ``param_specs`` (over the mesh's other axes) and the
        step's ``grad_accum`` (e.g. :meth:`batch_sizes`'s)."""
        size = {} if self.min_shard_size is None else {"min_shard_size": self.min_shard_size}
        return ZeroConfig(
            stage=self.stage,
            layout=Layout(param_specs=param_specs, **size),
            precision=self.precision,
            comm=self.comm,
            offload=self.offload,
            step=StepOptions(grad_accum=grad_accum),
        )

    def optimizer(
        self,
        mesh: Mesh,
        *,
        tx: optax.GradientTransformation | None = None,
        param_specs: Any = None,
    ) -> ZeroOptimizer:
        """A :class:`jzero.ZeroOptimizer` with :meth:`config`, around ``self.tx``, or around
        ``tx`` (after the config's clipping) when the config has no ``optimizer``."""
        if (tx is None) == (self.tx is None):
            raise ValueError(
                'the DeepSpeed config has an "optimizer": call optimizer(mesh) without tx.'
                if tx is not None
                else 'the DeepSpeed config has no "optimizer": pass optimizer(mesh, tx=...).'
            )
        tx = self.tx if tx is None else clipped(self.gradient_clipping, tx)
        return ZeroOptimizer(tx, mesh, config=self.config(param_specs=param_specs))


def from_deepspeed_config(
    config: str | os.PathLike | Mapping[str, Any], *, auto: Mapping[str, Any] | None = None
) -> DeepSpeedOptions:
    """Reads a DeepSpeed JSON config (a path, or the parsed dict) into jzero's options.

    A file may have comments (``#``, ``//``, ``/* */``), as DeepSpeed's hjson reader allows;
    a key given twice in one object is refused, as DeepSpeed refuses it. Warns once
    (:class:`DeepSpeedConfigWarning`) listing the keys that change nothing in jzero, with why
    -- including an optimizer lr that the scheduler replaces. Raises one
    :class:`DeepSpeedConfigError` (a ``ValueError``) naming every key jzero cannot use, each
    with why and the fix.

    Args:
        config: the config file's path, or its parsed dict.
        auto: values for the Hugging Face Trainer's ``"auto"`` placeholders, by dotted path
            (``{"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4}``), as the
            Trainer fills them from its arguments. Only ``"auto"`` values are filled.

    Examples:
        >>> ds = jzero.from_deepspeed_config("examples/deepspeed/zero2_fp16.json")
        >>> opt = ds.optimizer(jzero.data_mesh())
        >>> k = ds.batch_sizes(data_parallel_size=opt.data_size * opt.replica_size).grad_accum
        >>> train_step = opt.train_step(loss_fn, grad_accum=k)
    """
    findings = Findings()
    raw = fill_auto(_parsed(config, findings), {} if auto is None else auto, findings)
    top = Section(raw, path="", table=TOP, findings=findings)
    precision, zero = attempt(read_precision, top), attempt(read_zero, top)
    clip = attempt(_clipping, top)
    optimizer = read_optimizer(top)
    schedule = read_schedule(top, optimizer)
    findings.raise_problems()  # all of them; the config is read
    learning_rate = schedule
    if schedule is None and optimizer is not None:
        learning_rate = optimizer.lr
    tx = None if optimizer is None else clipped(clip, optimizer.tx(learning_rate))
    findings.warn_notes(stacklevel=2)
    return DeepSpeedOptions(
        stage=zero.stage,
        # ZeRO++ qwZ and qgZ: int8 all-gathers and gradient reduce-scatters, blockwise scales.
        precision=precision,
        # and hpZ's secondary partition: zero_hpz_partition_size
        comm=Communication(
            gather_quant=zero.gather_quant, grad_quant=zero.grad_quant, hpz=zero.hpz
        ),
        offload=zero.offload,
        tx=tx,
        learning_rate=learning_rate,
        gradient_clipping=clip,
        min_shard_size=zero.min_shard_size,
        train_batch_size=top["train_batch_size"],
        micro_batch_size=top["train_micro_batch_size_per_gpu"],
        grad_accum=top["gradient_accumulation_steps"],
    )


def _parsed(config: str | os.PathLike | Mapping[str, Any], findings: Findings) -> Any:
    """The config's value: ``config`` itself, or its file read (comments allowed); a key
    given twice in the file is a problem."""
    if isinstance(config, Mapping):
        return config
    path = pathlib.Path(config)
    try:
        raw, repeated = parse_jsonc(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"DeepSpeed config {path} is not valid JSON: {e}. jzero reads JSON with comments; "
            "DeepSpeed's hjson reader also takes quoteless strings and trailing or missing "
            "commas: write those as JSON."
        ) from None
    for key, values in repeated.items():
        given = ", ".join(map(repr, values))
        findings.problem(
            key,
            f"{key} is given {len(values)} times in one object ({given}); DeepSpeed refuses "
            "duplicate keys too. Keep one.",
        )
    return raw


def _clipping(top: Section) -> float:
    clip = top["gradient_clipping"]
    if clip < 0:
        top.refuse("gradient_clipping", "use a positive bound, or 0 for none.")
    return clip
