"""``jzero.from_deepspeed_config``: the example configs give their options, the batch sizes
are completed as DeepSpeed completes them, the optimizer and its configuration are built
from them, and the example configs train the main job."""

import json
import math
import re
import sys

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _deepspeed import EXAMPLES, OFFLOAD, example, load, run_updates
from _paths import REPO
from jax.sharding import PartitionSpec as P

import jzero
from jzero.config import BatchSizes, DeepSpeedConfigWarning

ROOT = REPO
sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # noqa: E402

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


@pytest.mark.smoke  # a DeepSpeed config trains as single-device Optax
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
