"""A DeepSpeed config's ZeRO section: offloading (optimizer and parameters) and ZeRO++
(quantized weights and gradients, hpZ), each mapped to its jzero option or refused with
why."""

import re

import _models
import jax
import jax.numpy as jnp
import optax
import pytest
from _deepspeed import OFFLOAD, load

import jzero
from jzero.config import DeepSpeedConfigWarning

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
    assert ds.offload == jzero.Offload(optimizer="host", ratio=0.5)  # Twin-Flow's share
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
    }


@pytest.mark.parametrize("ratio", [0.25, 1])
def test_offload_optimizer_ratio_is_offloads_ratio(ratio):
    """ZeRO-Offload++'s Twin-Flow share: that much of the state on the host, the rest
    updated on the device."""
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    ds = load({"zero_optimization": zero})
    assert ds.offload == jzero.Offload(optimizer="host", ratio=ratio)
    opt = ds.optimizer(jzero.data_mesh(), tx=optax.adam(0.1))
    state = opt.init({f"w{i}": jnp.ones((8, 8)) for i in range(4)})
    on_host = [
        x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state.opt_state[0].mu)
    ]
    assert on_host == [True] * round(4 * ratio) + [False] * (4 - round(4 * ratio))


@pytest.mark.parametrize("ratio", [0, 1.5, -1])
def test_an_offload_ratio_outside_zero_to_one_is_refused_with_the_fix(ratio):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    with pytest.raises(jzero.config.DeepSpeedConfigError) as info:
        jzero.from_deepspeed_config({"zero_optimization": zero})
    assert (
        f"zero_optimization.offload_optimizer.ratio must be a number in (0, 1] (the share of "
        f'the optimizer state in host memory; to offload none of it, set "device": "none"), '
        f"got {ratio!r}."
    ) in str(info.value)


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
    "the whole optimizer state. Set zero_optimization.stage to 1, 2 or 3, or "
)


@pytest.mark.parametrize(
    ("zero", "error"),
    [
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            f"zero_optimization.offload_optimizer.device = 'cpu': {STAGES_1_TO_3}"
            '"device" to "none".',
        ),
        (
            {"cpu_offload": True},
            f"zero_optimization.cpu_offload = True: {STAGES_1_TO_3}cpu_offload to false.",
        ),
        (
            {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
            "zero_optimization.cpu_offload = True: it is DeepSpeed's older spelling of "
            "offload_optimizer; remove it and keep offload_optimizer alone (DeepSpeed refuses "
            "the two together too).",
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
            'zero_optimization.stage to 3, or "device" to "none".',
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
            "gradients; use stage 1, 2 or 3, or set it to false.",
        ),
        (
            {"stage": 2, "zero_quantized_weights": True},
            "zero_optimization.zero_quantized_weights = True: it quantizes stage 3's "
            "all-gathers; use stage 3, or set it to false.",
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
