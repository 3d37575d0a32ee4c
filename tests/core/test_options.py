"""The step's options and the optimizer's collectives as objects (``jzero.StepOptions``,
``jzero.Communication``): given once, checked when built, refused with the fix when
given the old way."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest
from _flax_models import linen_state, nnx_state
from _models import stacked_batch, stacked_loss, stacked_params

import jzero


def _opt(stage=3, **kwargs):
    return jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=stage, **kwargs)


def test_keyword_options_and_a_step_options_object_build_the_same_step():
    opt = _opt()
    state, batch = opt.init(stacked_params()), stacked_batch()
    by_keywords = opt.train_step(stacked_loss, donate=False, grad_accum=2)
    by_object = opt.train_step(stacked_loss, jzero.StepOptions(donate=False, grad_accum=2))
    (_, a), (_, b) = by_keywords(state, batch), by_object(state, batch)
    assert float(a["loss"]) == float(b["loss"])
    assert by_keywords.lower(state, batch).as_text() == by_object.lower(state, batch).as_text()


def test_step_options_are_frozen_and_checked():
    options = jzero.StepOptions(has_aux=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.has_aux = False
    with pytest.raises(ValueError, match="grad_accum must be a positive int, got 0"):
        jzero.StepOptions(grad_accum=0)
    with pytest.raises(TypeError, match="StepOptions.donate must be True or False, got 'yes'"):
        jzero.StepOptions(donate="yes")
    assert jzero.StepOptions(axis_name=["a", "b"]).axis_name == ("a", "b")


def test_train_step_refuses_both_forms_and_unknown_options():
    opt = _opt()
    with pytest.raises(TypeError, match="both a StepOptions and keyword options 'donate'"):
        opt.train_step(stacked_loss, jzero.StepOptions(), donate=False)
    with pytest.raises(TypeError, match="unknown options 'has_axu'"):
        opt.train_step(stacked_loss, has_axu=True)
    with pytest.raises(TypeError, match="unknown options 'prefetch'"):  # a Communication's
        opt.train_step(stacked_loss, prefetch=True)
    with pytest.raises(TypeError, match="must be a jzero.StepOptions, got dict"):
        opt.train_step(stacked_loss, {"has_aux": True})


@pytest.mark.parametrize(
    ("stage", "comm", "message"),
    [
        (2, {"gather_quant": "int8"}, "stage 2 gathers no parameters; use stage=3"),
        (1, {"gather_quant": "fp8"}, "stage 1 gathers no parameters; use stage=3"),
        (0, {"grad_quant": "int8"}, "stage 0 all-reduces its gradients; use stage=1, 2"),
        (2, {"prefetch": True}, "stage 2 gathers no parameters; use stage=3"),
    ],
)
def test_communication_conflicts_are_refused_when_the_optimizer_is_built(stage, comm, message):
    with pytest.raises(ValueError, match=message):
        _opt(stage, comm=jzero.Communication(**comm))


def test_communication_fields_are_checked():
    with pytest.raises(TypeError, match="Communication.bucket must be True or False, got 1"):
        jzero.Communication(bucket=1)
    with pytest.raises(TypeError, match="comm must be a jzero.Communication, got dict"):
        _opt(comm={"bucket": True})


@pytest.mark.parametrize("field", ["gather_quant", "grad_quant", "quant_block"])
def test_precision_has_no_communication_fields(field):
    """Quantized collectives are Communication's (the 0.1.0 shim that named the move is
    gone): Python's own error names the keyword."""
    value = 128 if field == "quant_block" else "int8"
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{field}'"):
        jzero.Precision(**{field: value})
    assert getattr(jzero.Communication(**{field: value}), field) == value


def test_precision_without_communication_fields_is_unchanged():
    p = jzero.Precision(param_dtype=jnp.bfloat16)
    assert dataclasses.replace(p, reduce_dtype=jnp.float32).param_dtype == jnp.bfloat16
    assert [f.name for f in dataclasses.fields(p)] == [
        "param_dtype",
        "reduce_dtype",
        "dynamic_loss_scale",
        "initial_loss_scale",
        "growth_interval",
    ]


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_adapters_refuse_with_model_state_as_a_user_option(adapter):
    state, _ = {"linen": linen_state, "nnx": nnx_state}[adapter](3)
    with pytest.raises(TypeError, match="with_model_state is the adapter's to set"):
        state.train_step(lambda *a: 0.0, with_model_state=True)
