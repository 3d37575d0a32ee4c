"""What the DeepSpeed config tests share: the example configs, the Hugging Face Trainer's
vendored ZeRO-2 config and its ``"auto"`` keys, readers of the warnings and errors, and
DeepSpeed's learning-rate formulas beside the Optax updates they are compared with."""

import json
import math

import _models
import jax
import optax
import pytest
from _paths import REPO, VENDOR

import jzero
from jzero.config import DeepSpeedConfigError

EXAMPLES = {
    name: REPO / "examples" / "deepspeed" / f"{name}.json"
    for name in ("zero2_fp16", "zero3", "zero3_offload")
}


# The Hugging Face Trainer's ZeRO-2 config, vendored unchanged (tests/vendor/.../SOURCE.md).
HF_ZERO2 = VENDOR / "transformers_deepspeed" / "ds_config_zero2.json"
# What offload_optimizer {"device": "cpu"} maps to: DeepSpeed runs the step on the CPU too.
OFFLOAD = jzero.Offload(optimizer="host")

HF_AUTO = (  # its "auto" keys, by dotted path, in sorted order
    "bf16.enabled",
    "fp16.enabled",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.lr",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_num_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
)


def example(name):
    return json.loads(EXAMPLES[name].read_text())


def load(config):
    """``from_deepspeed_config`` on a config that must not warn (warnings are errors here)."""
    return jzero.from_deepspeed_config(config)


def noted(record):
    """The keys that the one DeepSpeedConfigWarning in ``record`` names, in its order."""
    (warning,) = record
    return [line.split(":")[0].strip() for line in str(warning.message).splitlines()[1:]]


def problems(config, **kwargs):
    """The DeepSpeedConfigError that ``config`` raises; its message has one line per key."""
    with pytest.raises(DeepSpeedConfigError) as info:
        jzero.from_deepspeed_config(config, **kwargs)
    error = info.value
    lines = str(error).splitlines()
    assert len(lines) == (1 if len(error.keys) == 1 else 1 + len(error.keys)) + bool(error.auto)
    return error


def run_updates(tx, steps=3):
    """``steps`` updates of ``tx`` on the awkward parameters, eagerly; the final params."""
    params = _models.awkward_params()
    state = tx.init(params)
    for i in range(steps):
        keys = jax.random.split(jax.random.key(100 + i), len(params))
        grads = {k: jax.random.normal(key, x.shape) for key, (k, x) in zip(keys, params.items())}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def deepspeed_lr(kind, p, base_lr, it):
    """DeepSpeed's rate at ``last_batch_iteration = it``, written from the scheduler
    classes in deepspeed/runtime/lr_schedules.py (float64): it = -1 is the rate set at
    construction, used by the first update."""
    log_warmup = p.get("warmup_type", "log") == "log"
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo, hi, w = (
            p.get("warmup_min_lr", 0.0),
            p.get("warmup_max_lr", 0.001),
            max(2, p["warmup_num_steps"]),
        )
        if it < 0:
            return lo
        if it < w:
            gamma = math.log(it + 1) / math.log(w) if log_warmup else it / w
        elif kind == "WarmupLR":
            gamma = 1.0
        else:
            total = p["total_num_steps"]
            gamma = max(0.0, (total - it) / max(1.0, total - w))
        return lo + (hi - lo) * gamma
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        w, total = max(2, p["warmup_num_steps"]), p["total_num_steps"]
        if it < w:
            ratio = math.log(it + 1) / math.log(w) if log_warmup else it / w
            lo = p.get("warmup_min_ratio", 0.0)
            return base_lr * (lo + ratio * (1 - lo))
        end = p.get("cos_min_ratio", 0.0001)
        ratio = (1 + math.cos(math.pi * (it - w + 1) / (total - w))) / 2
        return base_lr * max(0.0, end + (1 - end) * ratio)
    if kind == "OneCycle":
        lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
        first = p["cycle_first_step_size"]
        total = first + p.get("cycle_second_step_size", first)
        if it < 0:
            return lo
        if it < total:
            batch = it + 1
            x = 1.0 + batch / total - math.floor(1 + batch / total)
            up = first / total
            return lo + (hi - lo) * (x / up if x <= up else (x - 1) / (up - 1))
        rate, every = p.get("decay_lr_rate", 0.0), p.get("decay_step_size", 0)
        return lo if rate == 0 or every == 0 else lo / (1 + rate * (it - total + 1) / every)
    assert kind == "LRRangeTest"
    lo, size, rate = (
        p["lr_range_test_min_lr"],
        p["lr_range_test_step_size"],
        p["lr_range_test_step_rate"],
    )
    if it < 0:
        return lo
    interval = (it + 1) / size
    return lo * (
        1 + rate * (math.floor(interval) if p.get("lr_range_test_staircase") else interval)
    )
