"""DeepSpeed's learning-rate schedulers as Optax schedules, update for update.

DeepSpeed sets a scheduler's rate for ``last_batch_iteration = -1`` when it builds it, and
steps the scheduler after every applied update (an fp16 step skipped for overflow does not
step it). So update number ``count`` -- Optax's count of applied updates, which a skipped
jzero step does not advance either -- uses DeepSpeed's rate at ``last_batch_iteration =
count - 1``. The formulas are those of ``deepspeed/runtime/lr_schedules.py``, in float32.

Every scheduler but ``WarmupCosineLR`` (which scales the optimizer's lr) sets the rate itself,
in DeepSpeed as here, so an ``optimizer.params.lr`` next to one is unused: it is warned, with
the rates used instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from .keys import (
    REQUIRED,
    Key,
    Section,
    attempt,
    boolean,
    integer,
    no_effect,
    number,
    one_of,
    positive,
)
from .optim import Optimizer

# DeepSpeed's warmup fraction gamma(it, W) at iteration it of W: "log" or "linear".
WARMUP = {
    "log": lambda it, w: jnp.log(jnp.maximum(it + 1, 1.0)) / math.log(w),
    "linear": lambda it, w: it / w,
}
RESUME = Key(
    integer,
    -1,
    refused="jzero resumes a schedule from the update count in its checkpoint "
    "(jzero.Checkpointer); set last_batch_iteration to -1 (or remove it).",
    matches=(-1,),
)
WARMUP_LR = {
    "warmup_min_lr": Key(number, 0.0),
    "warmup_max_lr": Key(number, 0.001),
    "warmup_num_steps": Key(integer, 1000),
    "warmup_type": Key(one_of(*WARMUP), "log"),
    "last_batch_iteration": RESUME,
}
WARMUP_DECAY_LR = {**WARMUP_LR, "total_num_steps": Key(positive, REQUIRED)}
WARMUP_COSINE_LR = {
    "total_num_steps": Key(positive, REQUIRED),
    "warmup_min_ratio": Key(number, 0.0),
    "warmup_num_steps": Key(integer, 1000),
    "cos_min_ratio": Key(number, 0.0001),
    "warmup_type": Key(one_of(*WARMUP), "log"),
    "last_batch_iteration": RESUME,
}
STAIRS = "DeepSpeed's OneCycle stores it but does not use it"
ONE_CYCLE = {
    "cycle_min_lr": Key(number, REQUIRED),
    "cycle_max_lr": Key(number, REQUIRED),
    "decay_lr_rate": Key(number, 0.0),
    "cycle_first_step_size": Key(positive, 2000),
    "cycle_second_step_size": Key(positive, None),
    "decay_step_size": Key(integer, 0),
    "cycle_first_stair_count": no_effect(STAIRS),
    "cycle_second_stair_count": no_effect(STAIRS),
    "cycle_momentum": Key(boolean, True),
    "cycle_min_mom": Key(number, 0.8),
    "cycle_max_mom": Key(number, 0.9),
    "decay_mom_rate": Key(number, 0.0),
    "last_batch_iteration": RESUME,
}
LR_RANGE_TEST = {
    "lr_range_test_min_lr": Key(number, 0.001),
    "lr_range_test_step_size": Key(positive, 2000),
    "lr_range_test_step_rate": Key(number, 1.0),
    "lr_range_test_staircase": Key(boolean, False),
    "last_batch_iteration": RESUME,
}


def _iteration(count: jax.Array) -> jax.Array:
    """DeepSpeed's ``last_batch_iteration`` during update number ``count``."""
    return jnp.asarray(count, jnp.float32) - 1


def warmup_lr(p: Section, *, decay: bool = False) -> optax.Schedule:
    """``WarmupLR`` (and ``WarmupDecayLR`` with ``decay``: linear to 0 at total_num_steps)."""
    lo, hi, warm = p["warmup_min_lr"], p["warmup_max_lr"], WARMUP[p["warmup_type"]]
    w = max(2, p["warmup_num_steps"])  # as DeepSpeed
    total = p["total_num_steps"] if decay else None

    def schedule(count):
        it = _iteration(count)
        after = 1.0 if total is None else jnp.maximum(0.0, (total - it) / max(1, total - w))
        gamma = jnp.where(it < w, warm(it, w), after)
        return jnp.where(it < 0, lo, lo + (hi - lo) * gamma)

    return schedule


def warmup_cosine_lr(p: Section, *, base_lr: float) -> optax.Schedule:
    """``WarmupCosineLR``: a ratio of the optimizer's lr, 0 for the first update."""
    total, w, warm = p["total_num_steps"], max(2, p["warmup_num_steps"]), WARMUP[p["warmup_type"]]
    if total <= w:
        p.refuse(
            "total_num_steps",
            f"it must exceed warmup_num_steps ({w}); raise it above {w}, or lower "
            "warmup_num_steps.",
        )
    lo, end = p["warmup_min_ratio"], p["cos_min_ratio"]

    def schedule(count):
        it = _iteration(count)
        warming = lo + warm(it, w) * (1.0 - lo)
        # DeepSpeed's (1 + cos(pi t)) / 2, as cos(pi t / 2) ** 2: no cancellation near 0.
        cosine = jnp.cos(math.pi / 2 * (it - w + 1) / (total - w)) ** 2
        ratio = jnp.where(it < w, warming, jnp.maximum(0.0, end + (1.0 - end) * cosine))
        return jnp.where(it < 0, 0.0, base_lr * ratio)

    return schedule


def one_cycle(p: Section, *, betas: bool) -> optax.Schedule:
    """``OneCycle``'s learning rate. Its momentum cycling is refused for optimizers with
    betas (jzero does not change beta1 during training) and has no effect without."""
    keys = [k for k in ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate") if k in p]
    why = "cycle_momentum is false"
    if p["cycle_momentum"]:
        if betas:
            p.refuse(
                "cycle_momentum",
                "jzero does not cycle the optimizer's beta1 (DeepSpeed's OneCycle also sets "
                "beta2 to 0.99); set it to false.",
            )
        keys = ["cycle_momentum"] * ("cycle_momentum" in p) + keys
        why = "the optimizer has no betas, so DeepSpeed does not cycle momentum either"
    for key in keys:
        p.note(key, why)
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    rate, every = p["decay_lr_rate"], p["decay_step_size"]
    first = float(p["cycle_first_step_size"])
    second = first if p["cycle_second_step_size"] is None else float(p["cycle_second_step_size"])
    total = first + second
    up = first / total

    def schedule(count):
        batch = jnp.asarray(count, jnp.float32)  # DeepSpeed's last_batch_iteration + 1
        x = batch / total + 1 - jnp.floor(1 + batch / total)
        cycle = lo + (hi - lo) * jnp.where(x <= up, x / up, (x - 1) / (up - 1))
        decayed = lo
        if rate != 0 and every != 0:
            decayed = lo / (1 + rate * (batch - total) / every)
        return jnp.where(batch - 1 < total, cycle, decayed)

    return schedule


def lr_range_test(p: Section) -> optax.Schedule:
    lo, size = p["lr_range_test_min_lr"], p["lr_range_test_step_size"]
    rate = p["lr_range_test_step_rate"]
    staircase = p["lr_range_test_staircase"]

    def schedule(count):
        interval = jnp.asarray(count, jnp.float32) / size
        return lo * (1 + rate * (jnp.floor(interval) if staircase else interval))

    return schedule


# type -> (its params' table, the builder: (params, optimizer's lr, has betas)).
SCHEDULERS: dict[str, tuple[dict[str, Key], Callable[..., optax.Schedule]]] = {
    "WarmupLR": (WARMUP_LR, lambda p, lr, betas: warmup_lr(p)),
    "WarmupDecayLR": (WARMUP_DECAY_LR, lambda p, lr, betas: warmup_lr(p, decay=True)),
    "WarmupCosineLR": (WARMUP_COSINE_LR, lambda p, lr, betas: warmup_cosine_lr(p, base_lr=lr)),
    "OneCycle": (ONE_CYCLE, lambda p, lr, betas: one_cycle(p, betas=betas)),
    "LRRangeTest": (LR_RANGE_TEST, lambda p, lr, betas: lr_range_test(p)),
}
SCHEDULER = {"type": Key(one_of(*SCHEDULERS), REQUIRED), "params": Key(default={})}
# The rates that replace the optimizer's lr, by scheduler (WarmupCosineLR scales the lr).
RATES = {
    "WarmupLR": "from warmup_min_lr = {warmup_min_lr!r} to warmup_max_lr = {warmup_max_lr!r}",
    "WarmupDecayLR": "from warmup_min_lr = {warmup_min_lr!r} to warmup_max_lr = "
    "{warmup_max_lr!r}, then down to 0",
    "OneCycle": "between cycle_min_lr = {cycle_min_lr!r} and cycle_max_lr = {cycle_max_lr!r}",
    "LRRangeTest": "from lr_range_test_min_lr = {lr_range_test_min_lr!r} up",
}


def read_schedule(top: Section, optimizer: Optimizer | None) -> optax.Schedule | None:
    """The Optax schedule for the config's ``"scheduler"``; None when it has none. The
    ``optimizer`` (None: the config has none) gives WarmupCosineLR its lr and OneCycle its
    betas; an lr that the schedule replaces is noted."""
    if "scheduler" not in top:
        return None
    return attempt(_read, top, optimizer)


def _read(top: Section, optimizer: Optimizer | None) -> optax.Schedule:
    section = top.section("scheduler", SCHEDULER)
    kind = section["type"]
    table, build = SCHEDULERS[kind]
    params = section.section("params", table)
    if kind == "WarmupCosineLR" and optimizer is None:
        section.refuse(
            "type",
            'WarmupCosineLR scales the optimizer\'s lr; add an "optimizer", or use a scheduler '
            "that sets the rate itself (WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest).",
        )
    if optimizer is None:  # the caller's own tx, assumed to have betas
        return build(params, None, True)
    schedule = build(params, optimizer.lr, optimizer.betas)
    if kind in RATES and optimizer.params is not None and "lr" in optimizer.params:
        optimizer.params.note(
            "lr",
            f"{optimizer.params['lr']!r} is not used: the scheduler {kind} sets every update's "
            f"rate, {RATES[kind].format_map(params)}, as in DeepSpeed. Remove "
            "optimizer.params.lr to silence this.",
        )
    return schedule
