"""DeepSpeed's ``"zero_optimization"``: the stage, the stage-3 persistence threshold as
``min_shard_size``, ZeRO++ quantized weights as ``Precision(gather_quant="int8")``;
offloading, qgZ and hpZ refused; the performance knobs jzero has no use for warned.

``stage3_param_persistence_threshold``: DeepSpeed keeps parameters of at most that many
elements whole at stage 3 (``numel <= threshold``); jzero's ``min_shard_size`` keeps leaves
of fewer elements replicated, so it is the threshold + 1. DeepSpeed still partitions those
parameters' gradients and optimizer state; jzero replicates them too (more memory, the same
numbers).
"""

from __future__ import annotations

from typing import Any

from .keys import Key, Section, boolean, integer, no_effect, one_of, positive


def stage(value: Any) -> int:
    value = integer(value)
    if value not in (0, 1, 2, 3):
        raise TypeError("0, 1, 2 or 3")
    return value


BUCKETS = (
    "jzero buckets by layer, not by size: pass train_step(..., bucket=True) for one flat "
    "collective per layer"
)
GATHERS = (
    "stage 3 gathers per layer by itself (in scans; jax.checkpoint'ed layers); for one "
    "layer of prefetch pass train_step(..., prefetch=True)"
)
QGZ = (
    "quantized gradient reduce-scatters (ZeRO++ qgZ) are not implemented in jzero; "
    "gradients are reduced in Precision.reduce_dtype (communication_data_type)."
)
HPZ = (
    "jzero has no secondary partition (ZeRO++ hpZ); for sharding within groups of devices "
    "use a hybrid mesh, jzero.hybrid_mesh(replicas) (HSDP)."
)
NO_OFFLOAD = no_effect('nothing is offloaded ("device": "none")')
OFFLOADING = (
    "offloading to CPU or NVMe is not implemented in jzero: every state stays on the "
    'accelerator. Use "device": "none", a higher stage or more devices (python -m jzero '
    "estimate shows what fits)."
)
OFFLOAD = {
    "device": Key(one_of("none", "cpu", "nvme"), "none", refused=OFFLOADING, matches=("none",)),
    **dict.fromkeys(
        ("pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "ratio"),
        NO_OFFLOAD,
    ),
    **dict.fromkeys(("fast_init", "pipeline_read", "pipeline_write"), NO_OFFLOAD),
}
ZERO = {
    "stage": Key(stage, 0),
    "stage3_param_persistence_threshold": Key(integer),  # -> min_shard_size at stage 3
    "offload_optimizer": Key(default={}),
    "offload_param": Key(default={}),
    "cpu_offload": Key(default=False, refused=OFFLOADING, matches=(False,)),
    "overlap_comm": no_effect("XLA's scheduler decides what overlaps with what"),
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
    "zero_quantized_weights": Key(boolean, False),  # -> Precision(gather_quant="int8")
    "zero_quantized_gradients": Key(boolean, False, refused=QGZ, matches=(False,)),  # fmt: skip
    "zero_hpz_partition_size": Key(positive, 1, refused=HPZ, matches=(1,)),
    "sub_group_size": no_effect("the update is one XLA program over every shard"),
    "round_robin_gradients": no_effect("it concerns CPU offload, which jzero does not do"),
    "elastic_checkpoint": no_effect("jzero.Checkpointer restores on any device count"),
    "ignore_unused_parameters": no_effect("unused parameters get zero gradients"),
}


def read_zero(top: Section) -> tuple[int, int | None, bool]:
    """``(stage, min_shard_size or None, quantized weights)`` from the top level ``top``."""
    zero = top.section("zero_optimization", ZERO)
    for key in ("offload_optimizer", "offload_param"):
        zero.section(key, OFFLOAD)
    quantized = zero["zero_quantized_weights"]
    if quantized and zero["stage"] != 3:
        zero.refuse("zero_quantized_weights", "it quantizes stage 3's all-gathers; use stage 3.")
    key = "stage3_param_persistence_threshold"
    if key not in zero:
        return zero["stage"], None, quantized
    if zero["stage"] != 3:
        zero.note(key, "DeepSpeed uses it at stage 3 only")
        return zero["stage"], None, quantized
    return 3, max(0, zero[key]) + 1, quantized
