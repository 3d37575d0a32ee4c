"""A DeepSpeed config's optimizer, clipping and schedule: the same Optax update as hand-built
Optax, schedules step for step as DeepSpeed's formulas, and the notes that reach the
user."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _deepspeed import deepspeed_lr, example, load, noted, run_updates

import jzero
from jzero.config import DeepSpeedConfigWarning

# ------------------------------------------------------------------ optimizer and clipping

OPTIMIZERS = [  # (config's "optimizer", the same update in plain Optax)
    (
        {
            "type": "AdamW",
            "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1},
        },
        lambda: optax.adamw(0.01, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.1),
    ),
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false (then L2).
    (
        {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}},
        lambda: optax.adamw(0.01, weight_decay=0.1),
    ),
    (
        {"type": "adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}},
        lambda: optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01)),
    ),
    # FusedAdam's defaults; torch.optim.AdamW's default decay of 0.01 with torch_adam.
    ({"type": "Adam"}, lambda: optax.adamw(1e-3, weight_decay=0.0)),
    (
        {"type": "AdamW", "params": {"torch_adam": True}},
        lambda: optax.adamw(1e-3, weight_decay=0.01),
    ),
    (
        {
            "type": "SGD",
            "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        },
        lambda: optax.chain(
            optax.add_decayed_weights(0.01), optax.sgd(0.1, momentum=0.9, nesterov=True)
        ),
    ),
    ({"type": "SGD", "params": {"lr": 0.1}}, lambda: optax.sgd(0.1)),
    # FusedLion's betas default to (0.9, 0.999), optax.lion's to (0.9, 0.99).
    (
        {"type": "Lion", "params": {"weight_decay": 0.1}},
        lambda: optax.lion(1e-3, b2=0.999, weight_decay=0.1),
    ),
]


@pytest.mark.parametrize(
    ("optimizer", "optax_tx"),
    OPTIMIZERS,
    ids=[f"{i}-{o['type']}" for i, (o, _) in enumerate(OPTIMIZERS)],
)
def test_optimizer_is_the_same_optax_update(optimizer, optax_tx):
    ds = load({"optimizer": optimizer, "gradient_clipping": 0.5})
    got = run_updates(ds.tx)
    want = run_updates(optax.chain(optax.clip_by_global_norm(0.5), optax_tx()))
    jax.tree.map(np.testing.assert_array_equal, got, want)  # bitwise


def test_scheduled_tx_is_the_optimizer_on_the_schedule():
    cfg = example("zero2_fp16")
    with pytest.warns(DeepSpeedConfigWarning):
        ds = jzero.from_deepspeed_config(cfg)
    p = cfg["optimizer"]["params"]
    (b1, b2), clip = p["betas"], cfg["gradient_clipping"]
    adamw = optax.adamw(
        ds.learning_rate, b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"]
    )
    want = run_updates(optax.chain(optax.clip_by_global_norm(clip), adamw), steps=4)
    jax.tree.map(np.testing.assert_array_equal, run_updates(ds.tx, steps=4), want)


# ------------------------------------------------------------------ schedules vs DeepSpeed


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 3e-3, "warmup_num_steps": 1}),  # DeepSpeed takes 2
    ("WarmupDecayLR", {"warmup_max_lr": 3e-3, "warmup_num_steps": 10, "total_num_steps": 30}),
    ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 30, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 30}),
    (
        "WarmupCosineLR",
        {
            "warmup_num_steps": 8,
            "total_num_steps": 30,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.2,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 8,
            "cycle_momentum": False,
        },
    ),
    (
        "OneCycle",
        {
            **{"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 8},
            **{
                "cycle_second_step_size": 6,
                "decay_step_size": 5,
                "decay_lr_rate": 0.5,
                "cycle_momentum": False,
            },
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 4,
            "lr_range_test_step_rate": 0.5,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 4,
            "lr_range_test_step_rate": 0.5,
            "lr_range_test_staircase": True,
        },
    ),
]


@pytest.mark.parametrize(("kind", "params"), SCHEDULES)
def test_schedule_follows_deepspeed_update_for_update(kind, params):
    base_lr = 2e-3  # WarmupCosineLR's; the other schedules replace the lr (warned when given)
    lr = {"lr": base_lr} if kind == "WarmupCosineLR" else {}
    ds = load(
        {
            "optimizer": {"type": "AdamW", "params": lr},
            "scheduler": {"type": kind, "params": params},
        }
    )
    counts = range(40)  # warmup, decay and past the end
    got = [float(ds.learning_rate(jnp.int32(c))) for c in counts]
    want = [deepspeed_lr(kind, params, base_lr, c - 1) for c in counts]
    # float32 against float64: to float32 rounding, relative to the peak rate.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * max(want))


def test_schedule_without_optimizer_is_returned_for_your_own_tx():
    ds = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    assert ds.tx is None
    assert float(ds.learning_rate(jnp.int32(5))) == pytest.approx(
        deepspeed_lr("WarmupLR", {"warmup_num_steps": 10}, None, 4)
    )
    with pytest.raises(ValueError, match=r"no \"optimizer\": pass optimizer\(mesh, tx=\.\.\.\)"):
        ds.optimizer(jzero.data_mesh())


# ------------------------------------------------------------------ notes that reach the user


@pytest.mark.parametrize(("kind", "params"), [s for s in SCHEDULES if s[0] != "WarmupCosineLR"])
def test_optimizer_lr_replaced_by_the_scheduler_is_warned(kind, params):
    config = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": kind, "params": params}}
    without_lr = load(config)
    config["optimizer"]["params"] = {"lr": 0.5}
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(config)
    assert noted(record) == ["optimizer.params.lr"]
    counts = [jnp.int32(c) for c in range(40)]  # the scheduler's rates, not 0.5
    assert [float(ds.learning_rate(c)) for c in counts] == [
        float(without_lr.learning_rate(c)) for c in counts
    ]


def test_optimizer_lr_scaled_by_warmup_cosine_is_not_warned():
    params = {"warmup_num_steps": 10, "total_num_steps": 30}
    ds = load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "scheduler": {"type": "WarmupCosineLR", "params": params},
        }
    )
    # The 10th update ends the warmup at the optimizer's lr.
    assert float(ds.learning_rate(jnp.int32(10))) == pytest.approx(0.5, rel=1e-6)


def test_adam_w_mode_false_with_adamw_is_warned():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(
            {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}
        )
    assert noted(record) == ["optimizer.params.adam_w_mode"]
    want = run_updates(optax.adamw(1e-3, weight_decay=0.1))  # decoupled all the same
    jax.tree.map(np.testing.assert_array_equal, run_updates(ds.tx), want)
