"""The run's configuration as one frozen object (``jzero.ZeroConfig``): checked once when it
is built, taken by every entry point (the optimizer, both Flax train states, the DeepSpeed
reader), referred to by the plan, and the same run as the keyword spelling, bitwise."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import stacked_batch, stacked_loss, stacked_params
from jax.sharding import PartitionSpec as P

import jzero


def _opt(config=None, **keywords):
    return jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), config=config, **keywords)


def test_defaults_and_none_are_the_option_defaults():
    config = jzero.ZeroConfig(stage=2, precision=None, comm=None, offload=None, step=None)
    assert config == jzero.ZeroConfig(stage=2)
    assert config.layout == jzero.Layout() and config.precision == jzero.Precision()
    assert config.comm == jzero.Communication() and config.offload == jzero.Offload()
    assert config.step == jzero.StepOptions()
    assert jzero.ZeroConfig(stage=1, offload="optimizer").offload == jzero.Offload(
        optimizer="stream"
    )
    assert (config.partitions_opt_state, config.partitions_grads, config.partitions_params) == (
        True,
        True,
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"stage": 4}, ValueError, "stage must be 0, 1, 2 or 3, got 4"),
        ({"stage": True}, ValueError, "stage must be 0, 1, 2 or 3, got True"),
        ({"comm": {"bucket": True}}, TypeError, "comm must be a jzero.Communication, got dict"),
        ({"precision": "bf16"}, TypeError, "precision must be a jzero.Precision, got str"),
        ({"step": {"grad_accum": 2}}, TypeError, "step must be a jzero.StepOptions, got dict"),
        ({"layout": P()}, TypeError, "layout must be a jzero.Layout, got P;"),
        ({"offload": "cpu"}, ValueError, "offload must be None, 'optimizer'"),
        (
            {"stage": 2, "comm": jzero.Communication(gather_quant="int8")},
            ValueError,
            "stage 2 gathers no parameters; use stage=3",
        ),
        (
            {"stage": 0, "offload": jzero.Offload(optimizer="host")},
            ValueError,
            "needs stage >= 1",
        ),
        (
            {
                "stage": 2,
                "step": jzero.StepOptions(remat_policy=jax.checkpoint_policies.dots_saveable),
            },
            ValueError,
            "stage 2 has none; use stage=3",
        ),
    ],
)
def test_a_config_is_checked_once_when_built(changes, error, message):
    with pytest.raises(error, match=message):
        jzero.ZeroConfig(**{"stage": 3, **changes})
    if "stage" not in changes or changes["stage"] in (0, 1, 2, 3):  # a variant: checked again
        with pytest.raises(error, match=message):
            dataclasses.replace(jzero.ZeroConfig(stage=3), **changes)


def test_layout_is_checked_and_compares_by_value():
    specs = {"a": P(None, "model"), "b": {"c": P()}}
    one = jzero.Layout(param_specs=specs, rules=[("mlp", "model")], min_shard_size=4)
    two = jzero.Layout(
        param_specs={"b": {"c": P()}, "a": P(None, "model")},
        rules=(("mlp", "model"),),
        min_shard_size=4,
    )
    assert one == two and hash(one) == hash(two) and one.rules == (("mlp", "model"),)
    assert one != jzero.Layout(param_specs=specs, min_shard_size=4)
    assert hash(jzero.ZeroConfig(stage=3, layout=one)) == hash(
        jzero.ZeroConfig(stage=3, layout=two)
    )
    with pytest.raises(ValueError, match="min_shard_size must be >= 0, got -1"):
        jzero.Layout(min_shard_size=-1)
    with pytest.raises(TypeError, match="min_shard_size must be an int, got 2.0"):
        jzero.Layout(min_shard_size=2.0)
    with pytest.raises(TypeError, match="param_specs holds 'model'"):
        jzero.Layout(param_specs={"a": "model"})
    with pytest.raises(TypeError, match="rules entry 'mlp' is not a"):
        jzero.Layout(rules=["mlp"])


def test_what_needs_a_mesh_is_checked_by_the_optimizer():
    with pytest.raises(ValueError, match="Communication\\(hpz=3\\) needs groups of 3 devices"):
        _opt(jzero.ZeroConfig(stage=3, comm=jzero.Communication(hpz=3)))
    with pytest.raises(ValueError, match="maps 'mlp' to mesh axis 'model', but the mesh has"):
        _opt(jzero.ZeroConfig(stage=3, layout=jzero.Layout(rules=(("mlp", "model"),))))
    assert jzero.ZeroConfig(stage=3, comm=jzero.Communication(hpz=3)).stage == 3  # no mesh yet


def test_the_optimizer_takes_a_config_or_its_keywords_never_both():
    config = jzero.ZeroConfig(stage=3, layout=jzero.Layout(min_shard_size=8))
    by_keywords = _opt(stage=3, min_shard_size=8)
    assert by_keywords.config == _opt(config).config == config
    assert (by_keywords.stage, by_keywords.min_shard_size) == (3, 8)
    with pytest.raises(TypeError, match=r"got config= and the options \['stage'\] besides"):
        _opt(config, stage=2)
    with pytest.raises(TypeError, match="needs stage= \\(0, 1, 2 or 3\\), or config="):
        _opt()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['grad_accum'\]"):
        _opt(stage=3, grad_accum=2)
    with pytest.raises(TypeError, match="config must be a jzero.ZeroConfig, got dict"):
        _opt({"stage": 3})


def test_the_plan_refers_to_the_config_less_what_its_leaves_record():
    layout = jzero.Layout(min_shard_size=100_000)
    config = jzero.ZeroConfig(stage=3, layout=layout, step=jzero.StepOptions(grad_accum=2))
    plan = _opt(config).plan(stacked_params())
    assert plan.config == jzero.ZeroConfig(stage=3)  # layout: in the leaves; step: each step's
    assert not any(s.layout.sharded for s in plan.params)  # min_shard_size, in the leaves
    assert plan.stage == 3 and plan.config.partitions_params
    for copied in ("partitions_params", "offloads", "host_step", "offload_chunk", "offload"):
        assert not hasattr(plan, copied)


def test_train_step_starts_from_the_configs_step_options():
    opt = _opt(jzero.ZeroConfig(stage=3, step=jzero.StepOptions(grad_accum=2, donate=False)))
    assert opt.train_step(stacked_loss).config.step == jzero.StepOptions(grad_accum=2, donate=False)
    step = opt.train_step(stacked_loss, has_aux=False, donate=True)
    assert step.config.step == jzero.StepOptions(grad_accum=2, donate=True)
    given = jzero.StepOptions(has_aux=False)
    assert opt.train_step(stacked_loss, given).config.step == given  # replaces it whole


def _run(opt, steps=2, **options):
    state, step = opt.init(stacked_params()), opt.train_step(stacked_loss, **options)
    for _ in range(steps):
        state, metrics = step(state, stacked_batch())
    return opt.full_params(state), float(metrics["loss"])


def test_a_config_runs_bitwise_as_its_keywords():
    precision = jzero.Precision(param_dtype=jnp.bfloat16)
    config = jzero.ZeroConfig(
        stage=3,
        precision=precision,
        comm=jzero.Communication(bucket=True),
        step=jzero.StepOptions(grad_accum=2),
    )
    a = _run(_opt(config))
    b = _run(
        _opt(stage=3, precision=precision, comm=jzero.Communication(bucket=True)), grad_accum=2
    )
    assert a[1] == b[1]
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])


def test_the_deepspeed_reader_produces_a_config():
    ds = jzero.from_deepspeed_config(
        {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 9},
            "bf16": {"enabled": True},
        }
    )
    config = ds.config(grad_accum=2)
    assert config == jzero.ZeroConfig(
        stage=3,
        layout=jzero.Layout(min_shard_size=10),
        precision=ds.precision,
        comm=ds.comm,
        offload=ds.offload,
        step=jzero.StepOptions(grad_accum=2),
    )
    assert ds.optimizer(jzero.data_mesh(), tx=optax.sgd(0.1)).config == ds.config()


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(16)(x)))


def test_the_linen_train_state_takes_a_config():
    model, x = _Mlp(), jnp.ones((16, 8))
    variables = model.init(jax.random.key(0), x)

    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - 1.0) ** 2)

    common = {"apply_fn": model.apply, "tx": optax.adam(1e-2), "mesh": jzero.data_mesh()}
    config = jzero.ZeroConfig(stage=3, layout=jzero.Layout(min_shard_size=4))
    states = [
        jzero.linen.TrainState.create(variables=variables, config=config, **common),
        jzero.linen.TrainState.create(variables=variables, stage=3, min_shard_size=4, **common),
    ]
    assert states[0].opt.config == states[1].opt.config
    params = []
    for state in states:
        state, _ = state.train_step(loss_fn)(state, {"x": x})
        params.append(state.params)
    jax.tree.map(np.testing.assert_array_equal, *params)
    with pytest.raises(TypeError, match="jzero.linen.TrainState.create got config= and"):
        jzero.linen.TrainState.create(variables=variables, config=config, stage=3, **common)
