"""DeepSpeed's ``"fp16"``, ``"bf16"`` and ``"communication_data_type"`` as a
:class:`jzero.Precision`.

fp16: float16 parameters and compute, fp32 master weights, dynamic loss scaling from
``2 ** initial_scale_power``, doubled after ``loss_scale_window`` finite steps, halved (and
the step skipped) on overflow. jzero halves on the first overflow (DeepSpeed's
``hysteresis`` 1) and never goes below 1 (``min_loss_scale`` 1); other values are warned.
bf16: bfloat16 parameters and compute, fp32 master weights, no loss scaling. Gradients are
reduced in the parameters' dtype, as DeepSpeed does, unless ``communication_data_type``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from ..core.options.precision import Precision
from .keys import Key, Section, boolean, integer, no_effect, number, one_of, positive

REDUCE_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
FP16 = {
    "enabled": Key(boolean, False),
    "loss_scale": Key(
        number,
        0.0,
        refused="jzero scales the loss dynamically (loss_scale 0) or not at all; a fixed scale "
        "is not implemented. Set it to 0 (or remove it) for dynamic scaling.",
        matches=(0.0,),
    ),
    "initial_scale_power": Key(integer, 16),
    "loss_scale_window": Key(positive, 1000),
    "hysteresis": Key(
        integer,
        2,
        no_effect="jzero halves the scale on the first overflow (hysteresis 1); the step that "
        "overflows is skipped either way",
        matches=(1,),
    ),
    "consecutive_hysteresis": Key(
        boolean, False, no_effect="jzero has no hysteresis (it is 1)", matches=(False,)
    ),
    "min_loss_scale": Key(
        number, 1.0, no_effect="jzero's loss scale stops at 1 (min_loss_scale 1)", matches=(1.0,)
    ),
    "auto_cast": Key(
        boolean,
        False,
        no_effect="jzero hands loss_fn float16 parameters and leaves the batch as it is; cast "
        "the inputs in the model",
        matches=(False,),
    ),
    "fp16_master_weights_and_grads": Key(
        boolean,
        False,
        refused="jzero has no float16 master weights: for float16 parameters it keeps fp32 "
        "master weights in the optimizer's state (sharded over the devices from stage 1), "
        "updates them in fp32 and casts them down after each step. Remove the key, or set it "
        "to false, to train that way.",
        matches=(False,),
    ),
}
BF16 = {
    "enabled": Key(boolean, False),
    "immediate_grad_update": no_effect("jzero updates once per step, after the reduction"),
}


def switched(top: Section, name: str, table: Mapping[str, Key]) -> Section:
    """The object ``name`` read with ``table`` when its ``enabled`` is true; otherwise
    every key but ``enabled`` is noted as having no effect (DeepSpeed ignores them too)."""
    raw = top.values.get(name, {})
    if not (isinstance(raw, Mapping) and raw.get("enabled") is True):
        off = no_effect(f"{name}.enabled is not true")
        table = {k: table[k] if k == "enabled" else off for k in table}
    return top.section(name, table)


def read_precision(top: Section) -> Precision:
    """The :class:`Precision` of the config's top level ``top``."""
    fp16 = switched(top, "fp16", FP16)
    bf16 = switched(top, "bfloat16" if "bfloat16" in top and "bf16" not in top else "bf16", BF16)
    if fp16["enabled"] and bf16["enabled"]:
        top.refuse(
            "fp16",
            "fp16 and bf16 cannot both be enabled (DeepSpeed refuses it too); set "
            "fp16.enabled or bf16.enabled to false.",
        )
    reduce = REDUCE_DTYPES.get(top["communication_data_type"])
    if bf16["enabled"]:
        return Precision(param_dtype=jnp.bfloat16, reduce_dtype=reduce)
    if not fp16["enabled"]:
        return Precision(reduce_dtype=reduce)
    return Precision(
        param_dtype=jnp.float16,
        reduce_dtype=reduce,
        dynamic_loss_scale=True,
        initial_loss_scale=2.0 ** fp16["initial_scale_power"],
        growth_interval=fp16["loss_scale_window"],
    )


COMMUNICATION = Key(one_of(*REDUCE_DTYPES))  # the top level's "communication_data_type"
