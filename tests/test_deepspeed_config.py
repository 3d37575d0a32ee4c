"""``jzero.from_deepspeed_config``: every honoured key gives its option (the optimizer and
schedule checked against hand-built Optax and DeepSpeed's formulas), every other key is
named in a warning or an error, and the example configs train the main job."""

import json
import math
import re
import sys
from pathlib import Path

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jzero
from jzero.config import BatchSizes, DeepSpeedConfigError, DeepSpeedConfigWarning, jsonc

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # noqa: E402

EXAMPLES = {
    name: ROOT / "examples" / "deepspeed" / f"{name}.json"
    for name in ("zero2_fp16", "zero3", "zero3_offload")
}


# The Hugging Face Trainer's ZeRO-2 config, vendored unchanged (tests/vendor/.../SOURCE.md).
HF_ZERO2 = Path(__file__).parent / "vendor" / "transformers_deepspeed" / "ds_config_zero2.json"
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


# ------------------------------------------------------------------ the example configs


def test_zero2_fp16_example_maps_to_its_options():
    cfg = example("zero2_fp16")
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(EXAMPLES["zero2_fp16"])
    fp16, zero = cfg["fp16"], cfg["zero_optimization"]
    assert ds.stage == zero["stage"] == 2
    assert ds.precision == jzero.Precision(
        param_dtype=jnp.float16,
        reduce_dtype=jnp.float16,  # DeepSpeed reduces in the parameters' dtype
        dynamic_loss_scale=True,
        initial_loss_scale=2.0 ** fp16["initial_scale_power"],
        growth_interval=fp16["loss_scale_window"],
    )
    k, n = cfg["gradient_accumulation_steps"], jax.device_count()
    assert ds.batch_sizes(data_parallel_size=n) == BatchSizes(
        cfg["train_batch_size"], cfg["train_batch_size"] // (k * n), k
    )
    assert ds.min_shard_size is None and ds.gradient_clipping == cfg["gradient_clipping"]
    # One warning, naming each key that changes nothing here.
    (warning,) = record
    for key in ("steps_per_print", "wall_clock_breakdown", "fp16.hysteresis"):
        assert f"\n  {key}: " in str(warning.message)
    for key in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size"):
        assert f"\n  zero_optimization.{key}: " in str(warning.message)


def test_zero3_example_maps_to_its_options():
    cfg = example("zero3")
    with pytest.warns(DeepSpeedConfigWarning, match="stage3_prefetch_bucket_size"):
        ds = jzero.from_deepspeed_config(EXAMPLES["zero3"])
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "none"}
    assert ds.stage == 3
    assert ds.precision == jzero.Precision(param_dtype=jnp.bfloat16)
    assert ds.min_shard_size == zero["stage3_param_persistence_threshold"] + 1
    micro, n = cfg["train_micro_batch_size_per_gpu"], jax.device_count()
    assert ds.batch_sizes(data_parallel_size=n) == BatchSizes(micro * n, micro, 1)
    assert ds.offload is None


def test_zero3_offload_example_is_zero3_with_the_optimizer_in_host_memory():
    cfg, zero3 = example("zero3_offload"), example("zero3")
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg == {**zero3, "zero_optimization": {**zero3["zero_optimization"], **zero}}
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(EXAMPLES["zero3_offload"])
    assert "offload_optimizer" not in str(record[0].message)  # pin_memory: what jzero does
    with pytest.warns(DeepSpeedConfigWarning):
        plain = jzero.from_deepspeed_config(EXAMPLES["zero3"])
    assert ds.offload == OFFLOAD and plain.offload is None
    assert (ds.stage, ds.precision, ds.min_shard_size) == (3, plain.precision, plain.min_shard_size)
    opt = ds.optimizer(jzero.data_mesh())
    assert (
        opt.offload == OFFLOAD
        and opt.plan(_models.awkward_params()).config.offload.optimizer is not None
    )


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


# ------------------------------------------------------------------ keys named


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation"),
        ({"zero_optimization": {"stage": 2, "foo": 1}}, "zero_optimization.foo"),
        (
            {"zero_optimization": {"offload_param": {"device": "none", "bar": 1}}},
            "zero_optimization.offload_param.bar",
        ),
        ({"fp16": {"enabled": True, "scale": 1}}, "fp16.scale"),
        ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}},
            "scheduler.params.warmup_steps",
        ),
    ],
)
def test_unknown_key_is_named_with_the_accepted_ones(config, path):
    with pytest.raises(
        ValueError, match=rf"unknown key '{re.escape(path)}'\. jzero accepts at .*: "
    ):
        load(config)


@pytest.mark.parametrize(
    ("config", "path"),
    [
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.device = 'nvme'",
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.device = 'nvme'",
        ),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale = 128.0"),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type = 'Lamb'"),
        ({"optimizer": {"type": "Adagrad"}}, "optimizer.type = 'Adagrad'"),
        ({"optimizer": {"type": "RMSprop"}}, "optimizer.type = 'RMSprop'"),
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm",
        ),
        ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "optimizer.params.nesterov"),
        (
            {
                "optimizer": {"type": "Adam"},
                "scheduler": {
                    "type": "OneCycle",
                    "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1},
                },
            },
            "scheduler.params.cycle_momentum = True (absent: DeepSpeed's default)",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "warmup_num_steps": 2},
                }
            },
            "scheduler.type",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
            "scheduler.params.last_batch_iteration",
        ),
        ({"scheduler": {"type": "WarmupDecayLR"}}, "scheduler.params.total_num_steps is required"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"train_batch_size": "auto"}, "train_batch_size must be an integer, got 'auto'"),
        (
            {"gradient_accumulation_steps": 0},
            "gradient_accumulation_steps must be a positive integer",
        ),
    ],
)
def test_key_jzero_cannot_honour_is_named(config, path):
    with pytest.raises(ValueError, match=f"^DeepSpeed config: {re.escape(path)}"):
        load(config)


def test_keys_matching_jzero_pass_without_warning():
    """Values that say what jzero does anyway are honoured silently (warnings are errors)."""
    load(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "hysteresis": 1,
                "min_loss_scale": 1,
                "auto_cast": False,
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "none"},
                "reduce_scatter": True,
            },
            "prescale_gradients": False,
        }
    )


def test_disabled_fp16_keys_are_warned_not_used():
    with pytest.warns(
        DeepSpeedConfigWarning, match=r"fp16\.initial_scale_power: fp16\.enabled is not true"
    ):
        ds = jzero.from_deepspeed_config({"fp16": {"enabled": False, "initial_scale_power": 8}})
    assert ds.precision == jzero.Precision()


def test_persistence_threshold_warned_below_stage_3():
    with pytest.warns(
        DeepSpeedConfigWarning,
        match="stage3_param_persistence_threshold: DeepSpeed uses it at stage 3 only",
    ):
        ds = jzero.from_deepspeed_config(
            {"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 10}}
        )
    assert ds.min_shard_size is None


# ------------------------------------------------------------------ batch sizes


@pytest.mark.parametrize(
    ("given", "n", "want"),
    [  # (DeepSpeed's keys, devices, (train, micro, accumulation)) as DeepSpeed completes them
        (
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
            },
            8,
            (32, 2, 2),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 8, (32, 2, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 8, (32, 1, 4)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
        ({"train_batch_size": 16}, 8, (16, 2, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 8, (24, 3, 1)),
    ],
)
def test_batch_sizes_completed_as_deepspeed_does(given, n, want):
    assert load(given).batch_sizes(data_parallel_size=n) == BatchSizes(*want)


@pytest.mark.parametrize(
    "given",
    [
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
        },
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2},
        {"train_batch_size": 32, "gradient_accumulation_steps": 3},
        {"train_batch_size": 4},
    ],
)
def test_inconsistent_batch_sizes_are_refused(given):
    written = ", ".join(f"{k} {v}" for k, v in given.items())
    with pytest.raises(
        ValueError, match=f"DeepSpeed config: {written} on 8 data-parallel devices: "
    ):
        load(given).batch_sizes(data_parallel_size=8)


def test_batch_sizes_need_one_size():
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        load({"gradient_accumulation_steps": 2}).batch_sizes(data_parallel_size=8)


# ------------------------------------------------------------------ the ZeroOptimizer


def test_optimizer_trains_as_single_device_optax_with_small_leaves_replicated():
    threshold = 40  # elements: emb (520) and w1 (91) are sharded, the rest stays whole
    ds = load(
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        }
    )
    opt = ds.optimizer(jzero.data_mesh())
    assert (opt.stage, opt.min_shard_size) == (3, threshold + 1)
    params, batches = _models.awkward_params(), _models.awkward_batches(3)
    state = opt.init(params)
    for name, x in state.params.items():
        size = math.prod(_models.SHAPES[name])
        assert (x.sharding.spec != P()) == (size > threshold), name
    step = opt.train_step(_models.awkward_loss)
    for batch in batches:
        state, _ = step(state, batch)
    ref = _models.reference(ds.tx, params, _models.awkward_loss, batches)
    _models.assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=1e-6)


def test_optimizer_with_your_own_tx_gets_the_config_clipping():
    ds = load({"gradient_clipping": 0.5, "zero_optimization": {"stage": 1}})
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))
    want = run_updates(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)))
    jax.tree.map(np.testing.assert_array_equal, run_updates(opt.tx), want)
    with pytest.raises(
        ValueError, match=r"has an \"optimizer\": call optimizer\(mesh\) without tx"
    ):
        load({"optimizer": {"type": "SGD"}}).optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))


# ------------------------------------------------------------------ the main job

TINY = [
    *("--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16"),
    "--sample-tokens",
    "4",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_main_job_trains_with_example_config(name, tmp_path, capsys):
    steps = 6
    argv = [*TINY, "--steps", str(steps), "--eval-every", str(steps), "--out", str(tmp_path)]
    with pytest.warns(DeepSpeedConfigWarning), jax.numpy_dtype_promotion("standard"):
        assert train_lm.main([*argv, "--deepspeed-config", str(EXAMPLES[name])]) == 0
    with pytest.warns(DeepSpeedConfigWarning):
        ds = jzero.from_deepspeed_config(EXAMPLES[name])
    out, log = capsys.readouterr().out, (tmp_path / "train.log").read_text()
    assert f"stage {ds.stage} on {jax.device_count()} devices" in out
    sizes = ds.batch_sizes(data_parallel_size=jax.device_count())
    assert (
        f"'batch_size': {sizes.train_batch_size}" in log
        and f"'grad_accum': {sizes.grad_accum}" in log
    )
    lrs = [float(x) for x in re.findall(r"step \d+ loss \S+ grad_norm \S+ lr (\S+)", log)]
    want = [float(f"{float(ds.learning_rate(jnp.int32(i))):.2e}") for i in range(steps)]
    assert lrs == want  # the config's schedule, as logged
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", log)]
    assert len(losses) == steps and all(map(math.isfinite, losses))


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--stage", "1"],
            "--stage and --deepspeed-config both set it (zero_optimization.stage in ",
        ),
        (
            ["--precision", "bf16"],
            '--precision and --deepspeed-config both set it ("fp16" / "bf16" in ',
        ),
        (["--lr", "0.1"], '--lr and --deepspeed-config both set it ("optimizer" / "scheduler" in '),
        (
            ["--batch-size", "16"],
            "--batch-size and --deepspeed-config both set it (train_batch_size",
        ),
        (
            ["--offload"],
            "--offload and --deepspeed-config both set it (zero_optimization.offload_optimizer in ",
        ),
        (
            ["--offload-params"],
            "--offload-params and --deepspeed-config both set it "
            "(zero_optimization.offload_param in ",
        ),
        (
            ["--grad-quant", "int8"],
            "--grad-quant and --deepspeed-config both set it "
            "(zero_optimization.zero_quantized_gradients in ",
        ),
    ],
)
def test_main_job_refuses_a_flag_the_config_sets(flags, error, tmp_path, capsys):
    with pytest.warns(DeepSpeedConfigWarning), pytest.raises(SystemExit) as exit_info:
        train_lm.main(
            [
                *flags,
                "--out",
                str(tmp_path / "run"),
                "--deepspeed-config",
                str(EXAMPLES["zero2_fp16"]),
            ]
        )
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_main_job_refuses_a_config_that_does_not_fit(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 12, "zero_optimization": {"stage": 1}}))
    with pytest.raises(SystemExit):
        train_lm.main(["--out", str(tmp_path / "run"), "--deepspeed-config", str(path)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(
        f"error: --deepspeed-config {path}: DeepSpeed config: train_batch_size 12 on 8 "
        "data-parallel devices: train_batch_size must be train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps x 8. Change one of them."
    )


def _main_job_args(zero: dict, tmp_path):
    """train_lm's flags and optimizer from the zero3_offload example with ``zero`` added."""
    cfg = example("zero3_offload")
    cfg["zero_optimization"].update(zero)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    parser, argv = train_lm.make_parser(), ["--deepspeed-config", str(path)]
    args = parser.parse_args(argv)
    with pytest.warns(DeepSpeedConfigWarning):
        ds = train_lm.apply_deepspeed_config(parser, args, argv, jax.device_count())
    opt, _ = train_lm.make_optimizer(args, jzero.data_mesh(), ds)
    return args, opt, ds


def test_main_job_takes_offload_and_gradient_quantization_from_the_config(tmp_path):
    args, opt, ds = _main_job_args({"zero_quantized_gradients": True}, tmp_path)
    flags = (args.stage, args.offload, args.offload_params, args.grad_quant)
    assert flags == (3, "host", False, "int8")
    assert (opt.stage, opt.offload, opt.precision) == (3, OFFLOAD, ds.precision)
    assert opt.comm.grad_quant == "int8"


def test_main_job_takes_parameter_offload_from_the_config(tmp_path):
    args, opt, _ = _main_job_args({"offload_param": {"device": "cpu"}}, tmp_path)
    assert (args.stage, args.offload, args.offload_params) == (3, "host", True)
    assert opt.offload == jzero.Offload(optimizer="host", params=True)


# ------------------------------------------------------------------ offload and ZeRO++

OFFLOADED = {  # zero_optimization keys that offload the optimizer state to the CPU
    "cpu": {"offload_optimizer": {"device": "cpu"}},
    "pinned": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "cpu_offload": {"cpu_offload": True},  # DeepSpeed's older spelling
}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(OFFLOADED))
def test_optimizer_offload_to_the_cpu_is_offload_optimizer(stage, name):
    ds = load({"zero_optimization": {"stage": stage, **OFFLOADED[name]}})
    assert (ds.stage, ds.offload) == (stage, OFFLOAD)
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))
    assert (opt.stage, opt.offload) == (stage, OFFLOAD)


def test_sub_group_size_is_noted_the_host_step_has_no_chunks():
    zero = {"stage": 3, "sub_group_size": 1e6, **OFFLOADED["cpu"]}  # JSON's 1e6 is 10**6
    why = (
        "sub_group_size: the offloaded update runs on the host one whole leaf at a time (to "
        "bound a state streamed through the accelerator instead, use "
        "jzero.Offload(optimizer='stream', chunk=...))"
    )
    with pytest.warns(DeepSpeedConfigWarning, match=re.escape(why)):
        ds = jzero.from_deepspeed_config({"zero_optimization": zero})
    assert ds.offload == OFFLOAD
    assert ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1)).offload == OFFLOAD
    with pytest.warns(DeepSpeedConfigWarning, match="sub_group_size: without optimizer offload"):
        ds = jzero.from_deepspeed_config({"zero_optimization": {"stage": 3, "sub_group_size": 8}})
    assert ds.offload is None and ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))


@pytest.mark.parametrize(
    "zero",
    [
        {},
        {"stage": 2, "offload_optimizer": {"device": "none"}},
        {"stage": 2, "cpu_offload": False, "offload_param": {"device": "none"}},
    ],
)
def test_nothing_is_offloaded_without_a_cpu_device(zero):
    assert load({"zero_optimization": zero}).offload is None


def test_offload_knobs_are_warned_with_why():
    offload = {"device": "cpu", "pin_memory": False, "buffer_count": 4, "ratio": 0.5}
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(
            {
                "zero_force_ds_cpu_optimizer": True,
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {**offload, "fast_init": True},
                    "round_robin_gradients": True,
                },
            }
        )
    assert ds.offload == OFFLOAD
    (warning,) = record
    at = "zero_optimization.offload_optimizer"
    nvme = "it configures NVMe offload; jzero offloads to host memory only"
    assert set(str(warning.message).splitlines()[1:]) == {
        "  zero_force_ds_cpu_optimizer: with offload_optimizer on the CPU jzero runs any "
        "Optax update on the host",
        "  zero_optimization.round_robin_gradients: it spreads DeepSpeed's copies of the "
        "gradients to CPU memory over the ranks; in jzero each device copies down only its "
        "own gradient shards",
        f"  {at}.pin_memory: jzero always keeps offloaded state in pinned (page-locked) host "
        "memory",
        f"  {at}.buffer_count: {nvme}",
        f"  {at}.fast_init: {nvme}",
        f"  {at}.ratio: jzero offloads all of the optimizer state (ratio 1)",
    }


def test_offload_keys_without_a_cpu_device_are_warned_as_unused():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(
            {"zero_optimization": {"offload_optimizer": {"device": "none", "pin_memory": True}}}
        )
    assert ds.offload is None
    (warning,) = record
    assert str(warning.message).splitlines()[1:] == [
        '  zero_optimization.offload_optimizer.pin_memory: nothing is offloaded ("device": "none")'
    ]


STAGES_1_TO_3 = (
    "optimizer offload needs stage 1, 2 or 3 (as in DeepSpeed): at stage 0 every device holds "
    "the whole optimizer state. Set zero_optimization.stage to 1, 2 or 3."
)


@pytest.mark.parametrize(
    ("zero", "error"),
    [
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            f"zero_optimization.offload_optimizer.device = 'cpu': {STAGES_1_TO_3}",
        ),
        ({"cpu_offload": True}, f"zero_optimization.cpu_offload = True: {STAGES_1_TO_3}"),
        (
            {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
            "zero_optimization.cpu_offload = True: it is DeepSpeed's older spelling of "
            "offload_optimizer; keep offload_optimizer alone (DeepSpeed refuses the two "
            "together too).",
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
            "zero_optimization.offload_optimizer.device = 'nvme': jzero offloads to pinned host "
            'memory only, not to NVMe (ZeRO-Infinity). Use "device": "cpu" to keep the '
            'optimizer state in host memory, or "none".',
        ),
        (
            {"stage": 2, "offload_param": {"device": "cpu", "pin_memory": True}},
            "zero_optimization.offload_param.device = 'cpu': parameter offload needs stage 3 "
            "(as in DeepSpeed): below it every device holds the whole parameters. Set "
            "zero_optimization.stage to 3.",
        ),
        (
            {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}},
            "zero_optimization.offload_param.device = 'nvme': jzero offloads parameters to "
            'pinned host memory only, not to NVMe (ZeRO-Infinity). Use "device": "cpu" to '
            'keep stage 3\'s parameter shards in host memory, or "none".',
        ),
        (
            {"zero_quantized_gradients": True},
            "zero_optimization.zero_quantized_gradients = True: it quantizes the gradient "
            "reduce-scatter of stages 1-3 (ZeRO++ qgZ), and stage 0 all-reduces whole "
            "gradients; use stage 1, 2 or 3.",
        ),
        (
            {"stage": 2, "zero_quantized_weights": True},
            "zero_optimization.zero_quantized_weights = True: it quantizes stage 3's "
            "all-gathers; use stage 3.",
        ),
        (
            {"stage": 2, "zero_hpz_partition_size": 4},
            "zero_optimization.zero_hpz_partition_size = 4: a secondary partition (ZeRO++ "
            "hpZ) keeps stage 3's gathered parameters within groups of devices; use stage 3, "
            "or a size of 1.",
        ),
    ],
)
def test_offload_and_zero_plus_plus_refusals_say_why(zero, error):
    with pytest.raises(ValueError, match=f"^DeepSpeed config: {re.escape(error)}"):
        load({"zero_optimization": zero})


def test_zero_plus_plus_hpz_partition_size_maps_to_communication_hpz():
    ds = load({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    assert ds.comm == jzero.Communication(hpz=4)
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))
    assert opt.comm.hpz == 4
    # 1, DeepSpeed's default, is off
    ds = load({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert ds.comm == jzero.Communication() and ds.comm.hpz is None
    # a size that does not cut the data axis into groups is refused with the sizes that do
    ds = load({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})
    with pytest.raises(ValueError, match=r"hpz=3\) needs groups .* use hpz=one of \[2, 4\]"):
        ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))


def test_zero_plus_plus_quantized_weights_map_to_int8_gathers():
    ds = load({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert ds.stage == 3 and ds.comm == jzero.Communication(gather_quant="int8")
    assert ds.precision == jzero.Precision()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_plus_plus_quantized_gradients_map_to_int8_reduce_scatters(stage):
    ds = load({"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}})
    assert ds.stage == stage and ds.comm == jzero.Communication(grad_quant="int8")
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1))
    assert opt.comm.grad_quant == "int8"


def test_zero_plus_plus_weights_and_gradients_together():
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    ds = load({"bf16": {"enabled": True}, "zero_optimization": zero})
    assert ds.precision == jzero.Precision(param_dtype=jnp.bfloat16)
    assert ds.comm == jzero.Communication(gather_quant="int8", grad_quant="int8")


def test_optimizer_offloaded_by_the_config_trains_as_single_device_optax():
    ds = load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
    )
    opt = ds.optimizer(jzero.data_mesh())
    params, batches = _models.awkward_params(), _models.awkward_batches(3)
    state = opt.init(params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    step = opt.train_step(_models.awkward_loss)
    for batch in batches:
        state, _ = step(state, batch)
    ref = _models.reference(ds.tx, params, _models.awkward_loss, batches)
    full = opt.full_state(state)
    _models.assert_tree_close(full.params, ref.params, rtol=1e-6, atol=1e-6)
    _models.assert_tree_close(full.opt_state, ref.opt_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("zero", "offload"),
    [
        ({"offload_param": {"device": "cpu", "pin_memory": True}}, jzero.Offload(params=True)),
        (
            {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            jzero.Offload(optimizer="host", params=True),
        ),
    ],
)
def test_parameter_offload_maps_to_offload_params(zero, offload):
    ds = load({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **zero}})
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.adam(1e-2))
    assert opt.offload == offload
    state = opt.init(_models.stacked_params())
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert kinds((state.params, state.master)) == {"pinned_host"}
    assert kinds(state.opt_state) == {"pinned_host" if offload.optimizer else "device"}


# ------------------------------------------------------------------ every problem at once


def test_every_problem_is_named_in_one_error():
    error = problems(
        {
            "zero_optimisation": {"stage": 2},  # unknown
            "fp16": {"enabled": True, "loss_scale": 128},  # a fixed scale; and bf16 too
            "bf16": {"enabled": True},
            "gradient_clipping": -1,
            "train_batch_size": 0,
            "optimizer": {"type": "SGD", "params": {"nesterov": True}},  # without momentum
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_steps": 5}},
            "zero_optimization": {
                "stage": 0,
                "cpu_offload": True,  # at stage 0
                "offload_param": {"device": "nvme"},
            },
        }
    )
    assert error.keys == (
        "fp16",
        "fp16.loss_scale",
        "gradient_clipping",
        "optimizer.params.nesterov",
        "scheduler.params.total_num_steps",  # required
        "scheduler.params.warmup_steps",  # unknown
        "train_batch_size",
        "zero_optimisation",
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_param.device",
    )
    assert error.auto == () and isinstance(error, ValueError)


def test_a_bad_value_does_not_bring_false_problems_with_it():
    """A key whose value is refused is not read further: the keys that depend on it are not
    blamed for it (the stage is unknown, so offload at 'stage 0' is not refused)."""
    error = problems(
        {
            "zero_optimization": {"stage": "2", "cpu_offload": True, "foo": 1},
            "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1}},
        }
    )
    # Lamb's params are not read (no table for them), nor is OneCycle's momentum refused
    # (whether a refused optimizer has betas is unknown).
    assert error.keys == ("optimizer.type", "zero_optimization.foo", "zero_optimization.stage")


def test_hf_trainer_zero2_config_names_its_13_auto_keys_at_once():
    error = problems(HF_ZERO2)
    assert error.keys == error.auto == HF_AUTO and len(HF_AUTO) == 13
    # The last line is the call that fills them all from Python.
    fill = str(error).splitlines()[-1]
    assert "jzero.from_deepspeed_config(config, auto={" in fill
    assert tuple(re.findall(r'"([\w.]+)": \.\.\.', fill)) == HF_AUTO


HF_VALUES = {  # what a Trainer would fill in: bf16, batch 8 x 2 steps x 8 devices
    "bf16.enabled": True,
    "fp16.enabled": False,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer.params.betas": [0.9, 0.95],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.lr": 3e-4,
    "optimizer.params.weight_decay": 0.1,
    "scheduler.params.warmup_max_lr": 3e-4,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 10,
    "train_batch_size": 128,
    "train_micro_batch_size_per_gpu": 8,
}


def written(config, values):
    """``config`` with each dotted path in ``values`` set, as if written in the file."""
    config = json.loads(json.dumps(config))
    for path, value in values.items():
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        assert node[key] == "auto", path
        node[key] = value
    return config


def test_auto_fills_the_hf_config_as_if_written():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(HF_ZERO2, auto=HF_VALUES)
    # The optimizer's lr is replaced by WarmupLR's rates: warned, with the other keys.
    assert "optimizer.params.lr" in noted(record)
    config = json.loads(HF_ZERO2.read_text())
    with pytest.warns(DeepSpeedConfigWarning):
        assert jzero.from_deepspeed_config(config, auto=HF_VALUES)
    assert config == json.loads(HF_ZERO2.read_text())  # the caller's dict is left as it was
    with pytest.warns(DeepSpeedConfigWarning) as record_written:
        want = jzero.from_deepspeed_config(written(config, HF_VALUES))
    assert noted(record) == noted(record_written)
    same = ("stage", "precision", "offload", "gradient_clipping", "min_shard_size")
    assert [getattr(ds, f) for f in same] == [getattr(want, f) for f in same]
    assert (ds.stage, ds.offload, ds.precision) == (2, OFFLOAD, jzero.Precision(jnp.bfloat16))
    assert ds.batch_sizes(data_parallel_size=8) == BatchSizes(128, 8, 2)
    p = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}
    got = [float(ds.learning_rate(jnp.int32(c))) for c in range(15)]
    want_lr = [deepspeed_lr("WarmupLR", p, None, c - 1) for c in range(15)]
    np.testing.assert_allclose(got, want_lr, rtol=1e-6)  # float32 against float64
    adamw = optax.adamw(ds.learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    want_params = run_updates(optax.chain(optax.clip_by_global_norm(1.0), adamw), steps=4)
    jax.tree.map(np.testing.assert_array_equal, run_updates(ds.tx, steps=4), want_params)


def test_auto_fills_only_auto_values():
    error = problems(
        HF_ZERO2,
        auto={
            **HF_VALUES,
            "zero_optimization.stage": 3,  # written 2 in the config: never replaced
            "optimizer.params.momentum": 0.9,  # not in the config
            "train_batch_size": "128",  # filled values are checked like written ones
        },
    )
    assert error.keys == (
        "optimizer.params.momentum",
        "train_batch_size",
        "zero_optimization.stage",
    )
    assert error.auto == ()
    for auto in ([("train_batch_size", 8)], {("train_batch_size",): 8}):
        with pytest.raises(TypeError, match="^auto= maps dotted key paths to values"):
            jzero.from_deepspeed_config(HF_ZERO2, auto=auto)


# ------------------------------------------------------------------ the file: keys, comments


def test_duplicate_keys_are_refused_at_every_level(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        """{
          "train_batch_size": 8,
          "zero_optimization": {
            "stage": 2, "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": true, "device": "none"}
          },
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "lr": 0.2, "lr": 0.3}},
          "train_batch_size": 16
        }"""
    )
    error = problems(path)
    assert error.keys == (
        "optimizer.params.lr",
        "train_batch_size",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.stage",
    )
    assert jsonc.parse(path.read_text())[1] == {
        "train_batch_size": [8, 16],
        "zero_optimization.stage": [2, 3],
        "zero_optimization.offload_optimizer.device": ["cpu", "none"],
        "optimizer.params.lr": [0.1, 0.2, 0.3],
    }


COMMENTED = """// DeepSpeed reads configs with hjson: these comments are allowed there.
{
  # the batch
  "train_micro_batch_size_per_gpu": 4,  // per device
  /* the optimizer,
     with "quotes" and // inside a block comment */
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3 /* peak */, "betas": [0.9, 0.95]}},
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "nvme_path": "/mnt/#1//nvme/*x*/"}  # a string
  }
}
"""


def test_comments_are_read_as_deepspeed_does(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(COMMENTED)
    assert jsonc.parse(COMMENTED) == (
        {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "nvme_path": "/mnt/#1//nvme/*x*/"},
            },
        },
        {},
    )
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(path)
    assert noted(record) == ["zero_optimization.offload_optimizer.nvme_path"]
    assert (ds.stage, ds.offload, ds.micro_batch_size) == (2, OFFLOAD, 4)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (  # trailing comma: Python 3.13's json names the comma, 3.12's the "}" after it
            '{\n  /* a\n  comment */\n  "stage": 2,\n}',
            "line 4 column 13" if sys.version_info >= (3, 13) else "line 5 column 1",
        ),
        ('{\n  "optimizer": {"type": AdamW}\n}', "line 2 column 25"),  # a quoteless string
        ('{"stage": 2 /* never closed }', "line 1 column 13"),
    ],
)
def test_what_is_not_json_with_comments_is_refused_where_it_is(text, where, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(
        ValueError,
        match=f"^DeepSpeed config {re.escape(str(path))} is not valid JSON: .*: {where} ",
    ):
        jzero.from_deepspeed_config(path)


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
