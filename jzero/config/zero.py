"""DeepSpeed's ``"zero_optimization"``: the stage, the stage-3 persistence threshold as
``min_shard_size``, optimizer offload to the CPU as ``Offload(optimizer="host")``, ZeRO++ quantized
weights and gradients as ``Communication(gather_quant="int8")`` and
``Communication(grad_quant="int8")``, ZeRO++'s hpZ (``zero_hpz_partition_size``) as
``Communication(hpz=...)``, parameter offload to the CPU as ``Offload(params=True)``;
offloading to NVMe refused; the performance knobs jzero has no use for warned.

``offload_optimizer`` with ``"device": "cpu"`` (or DeepSpeed's older ``"cpu_offload": true``)
is ``jzero.Offload(optimizer="host")``: the sharded optimizer state and fp32 master weights
rest in pinned host memory and the Optax update runs on the host, as DeepSpeed runs its CPU
Adam there (:mod:`jzero.core.offload.host_step`), at stages 1-3 as in DeepSpeed. It is the
same split as DeepSpeed's (16-bit gradients down, 16-bit parameters up, no optimizer state
on the accelerator); jzero's other mode, streaming the state through the accelerator
(``Offload(optimizer="stream")``), has no DeepSpeed key. The numbers are those of the run
without offload. ``sub_group_size`` bounds the streamed mode's chunks only: with the
config's host step it changes nothing (noted). ``offload_optimizer.ratio`` (ZeRO-Offload++'s
Twin-Flow) is ``Offload(ratio=...)``: that share of the state on the host, the rest updated
on the device in the same step.

``offload_param`` with ``"device": "cpu"`` (stage 3 only, as in DeepSpeed) keeps stage 3's
parameter shards, and their fp32 master weights, in pinned host memory (ZeRO-Infinity's
parameter offload); each layer's shards are copied to the device where they are gathered,
in forward and again in backward. Parameters too small to be sharded (below
``stage3_param_persistence_threshold``) stay on the device, as DeepSpeed keeps them.

``stage3_param_persistence_threshold``: DeepSpeed keeps parameters of at most that many
elements whole at stage 3 (``numel <= threshold``); jzero's ``min_shard_size`` keeps leaves
of fewer elements replicated, so it is the threshold + 1. DeepSpeed still partitions those
parameters' gradients and optimizer state; jzero replicates them too (more memory, the same
numbers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from ..core.options.offload import Offload
from .keys import Key, Section, attempt, boolean, integer, no_effect, number, one_of, positive


def stage(value: Any) -> int:
    value = integer(value)
    if value not in (0, 1, 2, 3):
        raise TypeError("0, 1, 2 or 3")
    return value


BUCKETS = (
    "jzero buckets by layer, not by size: pass ZeroOptimizer(..., "
    "comm=Communication(bucket=True)) for one flat collective per layer"
)
GATHERS = (
    "stage 3 gathers per layer by itself (in scans; jax.checkpoint'ed layers); for one "
    "layer of prefetch pass comm=Communication(prefetch=True)"
)


def share(value: Any) -> float:
    """``offload_optimizer.ratio``: the share of the optimizer state offloaded, in (0, 1]."""
    value = number(value)
    if not 0 < value <= 1:
        raise TypeError(
            "a number in (0, 1] (the share of the optimizer state in host memory; to offload "
            'none of it, set "device": "none")'
        )
    return value


DEVICES = one_of("none", "cpu", "nvme")
NOTHING_OFFLOADED = no_effect('nothing is offloaded ("device": "none")')
NVME = (
    "jzero offloads to pinned host memory only, not to NVMe (ZeRO-Infinity). Use "
    '"device": "cpu" to keep the optimizer state in host memory, or "none".'
)
NVME_ONLY = no_effect("it configures NVMe offload; jzero offloads to host memory only")
NVME_PARAMS = (
    "jzero offloads parameters to pinned host memory only, not to NVMe (ZeRO-Infinity). Use "
    '"device": "cpu" to keep stage 3\'s parameter shards in host memory, or "none".'
)
PINNED = "jzero always keeps offloaded state in pinned (page-locked) host memory"
OFFLOAD_OPTIMIZER = {  # with "device": "cpu"; any other device: every key but it has no effect
    "device": Key(DEVICES, "none", refused=NVME, matches=("none", "cpu")),
    "pin_memory": Key(boolean, False, no_effect=PINNED, matches=(True,)),
    "ratio": Key(share, 1.0),  # -> Offload(ratio=...): ZeRO-Offload++'s Twin-Flow
    **dict.fromkeys(("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"), NVME_ONLY),
    **dict.fromkeys(("fast_init", "pipeline_read", "pipeline_write"), NVME_ONLY),
}
OFFLOAD_PARAM = {  # with "device": "cpu"; any other device: every key but it has no effect
    "device": Key(DEVICES, "none", refused=NVME_PARAMS, matches=("none", "cpu")),
    "pin_memory": Key(boolean, False, no_effect=PINNED, matches=(True,)),
    "ratio": Key(
        number, 1.0, no_effect="jzero offloads every sharded parameter (ratio 1)", matches=(1.0,)
    ),
    **dict.fromkeys(("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"), NVME_ONLY),
    **dict.fromkeys(("fast_init", "pipeline_read", "pipeline_write"), NVME_ONLY),
}
ZERO = {
    "stage": Key(stage, 0),
    "stage3_param_persistence_threshold": Key(integer),  # -> min_shard_size at stage 3
    "offload_optimizer": Key(default={}),  # "device": "cpu" -> Offload(optimizer=...)
    "offload_param": Key(default={}),
    "cpu_offload": Key(boolean, False),  # true: offload_optimizer's "device": "cpu"
    "overlap_comm": no_effect(
        "XLA's scheduler decides what overlaps with what; to let it overlap each layer's "
        "gradient reduce-scatter with the next layer's backward, for memory, pass "
        "comm=Communication(pipeline_scatter=True)"
    ),
    "contiguous_gradients": no_effect("XLA allocates the gradients; there is no flat buffer"),
    "reduce_bucket_size": no_effect(BUCKETS),
    "allgather_bucket_size": no_effect(BUCKETS),
    "reduce_scatter": Key(
        default=True, no_effect="stages 1-3 always reduce-scatter", matches=(True,)
    ),
    "allgather_partitions": Key(
        default=True, no_effect="stages 1-2 always all-gather", matches=(True,)
    ),
    "stage3_prefetch_bucket_size": no_effect(GATHERS),
    "stage3_max_live_parameters": no_effect(GATHERS),
    "stage3_max_reuse_distance": no_effect(GATHERS),
    "stage3_model_persistence_threshold": no_effect(
        "jzero has the per-leaf threshold only (stage3_param_persistence_threshold)"
    ),
    "stage3_gather_16bit_weights_on_model_save": no_effect(
        "jzero.checkpoint.export_safetensors writes the whole model"
    ),
    "zero_quantized_weights": Key(boolean, False),  # -> Communication(gather_quant="int8")
    "zero_quantized_gradients": Key(boolean, False),  # -> Communication(grad_quant="int8")
    "zero_hpz_partition_size": Key(positive, 1),  # > 1 -> Communication(hpz=...)
    "sub_group_size": Key(positive),  # noted: the host step has no chunks
    "round_robin_gradients": no_effect(
        "it spreads DeepSpeed's copies of the gradients to CPU memory over the ranks; in "
        "jzero each device copies down only its own gradient shards"
    ),
    "elastic_checkpoint": no_effect("jzero.Checkpointer restores on any device count"),
    "ignore_unused_parameters": no_effect("unused parameters get zero gradients"),
}


class Zero(NamedTuple):
    """What ``"zero_optimization"`` sets."""

    stage: int  # zero_optimization.stage (DeepSpeed's default 0)
    min_shard_size: int | None  # stage3_param_persistence_threshold + 1 at stage 3, else None
    offload: Offload | None  # offload_optimizer "cpu" / cpu_offload: the step on the host
    gather_quant: Literal["int8"] | None  # zero_quantized_weights: "int8"
    grad_quant: Literal["int8"] | None  # zero_quantized_gradients: "int8"
    hpz: int | None  # zero_hpz_partition_size when above 1 (ZeRO++ hpZ); else None


def read_zero(top: Section) -> Zero:
    """The options the top level ``top``'s ``"zero_optimization"`` sets."""
    zero = top.section("zero_optimization", ZERO)
    offload = attempt(_offload, zero)  # before the stage is read: its keys are checked
    stage = zero["stage"]
    gather_quant = "int8" if zero["zero_quantized_weights"] else None
    if gather_quant and stage != 3:
        zero.refuse(
            "zero_quantized_weights",
            "it quantizes stage 3's all-gathers; use stage 3, or set it to false.",
        )
    grad_quant = "int8" if zero["zero_quantized_gradients"] else None
    if grad_quant and stage == 0:
        zero.refuse(
            "zero_quantized_gradients",
            "it quantizes the gradient reduce-scatter of stages 1-3 (ZeRO++ qgZ), and stage 0 "
            "all-reduces whole gradients; use stage 1, 2 or 3, or set it to false.",
        )
    hpz = zero["zero_hpz_partition_size"] if zero["zero_hpz_partition_size"] > 1 else None
    if hpz and stage != 3:
        zero.refuse(
            "zero_hpz_partition_size",
            "a secondary partition (ZeRO++ hpZ) keeps stage 3's gathered parameters within "
            "groups of devices; use stage 3, or a size of 1.",
        )
    return Zero(stage, _min_shard_size(zero), offload, gather_quant, grad_quant, hpz)


def _note_sub_group_size(zero: Section, offloaded: bool) -> None:
    """``sub_group_size`` (elements per optimizer sub-step) changes nothing here: it would
    be ``Offload.chunk``, which bounds only a state streamed through the device."""
    if "sub_group_size" not in zero:
        return
    zero.note(
        "sub_group_size",
        "the offloaded update runs on the host one whole leaf at a time (to bound a state "
        "streamed through the accelerator instead, use jzero.Offload(optimizer='stream', "
        "chunk=...))"
        if offloaded
        else "without optimizer offload the update is one XLA program over every shard",
    )


def _min_shard_size(zero: Section) -> int | None:
    key = "stage3_param_persistence_threshold"
    if key not in zero:
        return None
    if zero["stage"] != 3:
        zero.note(key, "DeepSpeed uses it at stage 3 only")
        return None
    return max(0, zero[key]) + 1


def _offload(zero: Section) -> Offload | None:
    """The :class:`Offload` that ``offload_optimizer`` (or ``cpu_offload``) and
    ``offload_param`` set with ``"device": "cpu"``; refuses NVMe, both optimizer spellings
    at once, optimizer offload at stage 0 and parameter offload below stage 3."""
    optimizer, ratio = attempt(_offload_optimizer, zero) or (None, 1.0)
    param = zero.section("offload_param", _for_device(zero, "offload_param"))
    params = param["device"] == "cpu"
    if params and zero["stage"] != 3:
        param.refuse(
            "device",
            "parameter offload needs stage 3 (as in DeepSpeed): below it every device holds "
            'the whole parameters. Set zero_optimization.stage to 3, or "device" to "none".',
        )
    if optimizer is None and not params:
        return None
    return Offload(optimizer=optimizer, params=params, ratio=ratio)


def _offload_optimizer(zero: Section) -> tuple[Literal["host"], float] | None:
    """``("host", ratio)`` (the update runs on the host, as DeepSpeed's CPU Adam, for the
    ``ratio`` share of the state) when ``offload_optimizer`` (or ``cpu_offload``) offloads
    to the CPU."""
    optimizer = zero.section("offload_optimizer", _for_device(zero, "offload_optimizer"))
    if "cpu_offload" in zero and "offload_optimizer" in zero:
        zero.refuse(
            "cpu_offload",
            "it is DeepSpeed's older spelling of offload_optimizer; remove it and keep "
            "offload_optimizer alone (DeepSpeed refuses the two together too).",
        )
    if zero["cpu_offload"]:
        where, key = zero, "cpu_offload"
    elif optimizer["device"] == "cpu":
        where, key = optimizer, "device"
    else:
        _note_sub_group_size(zero, offloaded=False)
        return None
    if zero["stage"] == 0:
        off = '"device" to "none"' if key == "device" else "cpu_offload to false"
        where.refuse(
            key,
            "optimizer offload needs stage 1, 2 or 3 (as in DeepSpeed): at stage 0 every "
            "device holds the whole optimizer state. Set zero_optimization.stage to 1, 2 or 3, "
            f"or {off}.",
        )
    _note_sub_group_size(zero, offloaded=True)
    return "host", optimizer["ratio"] if key == "device" else 1.0  # cpu_offload: the whole


def _for_device(zero: Section, key: str) -> Mapping[str, Key]:
    """The table for ``zero[key]``: its own with ``"device": "cpu"``; with any other device
    every key but ``device`` has no effect (DeepSpeed ignores them too)."""
    table = OFFLOAD_OPTIMIZER if key == "offload_optimizer" else OFFLOAD_PARAM
    raw = zero.get(key, {})
    if isinstance(raw, Mapping) and raw.get("device") == "cpu":
        return table
    return {k: rule if k == "device" else NOTHING_OFFLOADED for k, rule in table.items()}
