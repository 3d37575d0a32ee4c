"""The step's options and the optimizer's collectives as objects (``jzero.StepOptions``,
``jzero.Communication``): given once, checked when built, refused with the fix when
given the old way."""

import dataclasses
import inspect
import pickle

import jax.numpy as jnp
import optax
import pytest
from _flax_models import linen_state, nnx_state
from _models import stacked_batch, stacked_loss, stacked_params
from jax.sharding import PartitionSpec as P

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
    with pytest.raises(TypeError, match=r"train_step\(prefetch=True\): prefetch moved to"):
        opt.train_step(stacked_loss, prefetch=True)  # a Communication's since the restructure
    with pytest.raises(TypeError, match="must be a jzero.StepOptions, got dict"):
        opt.train_step(stacked_loss, {"has_aux": True})


@pytest.mark.parametrize(
    ("stage", "comm", "message"),
    [
        (2, {"gather_quant": "int8"}, "stage 2 gathers no parameters; use stage=3"),
        (1, {"gather_quant": "fp8"}, "stage 1 gathers no parameters; use stage=3"),
        (0, {"grad_quant": "int8"}, "stage 0 all-reduces its gradients; use stage=1, 2"),
        (2, {"prefetch": True}, "stage 2 gathers no parameters; use stage=3"),
        (0, {"pipeline_scatter": True}, "stage 0 all-reduces its gradients; use stage=1, 2"),
    ],
)
def test_communication_conflicts_are_refused_when_the_optimizer_is_built(stage, comm, message):
    with pytest.raises(ValueError, match=message):
        _opt(stage, comm=jzero.Communication(**comm))


def test_communication_fields_are_checked():
    with pytest.raises(TypeError, match="Communication.bucket must be True or False, got 1"):
        jzero.Communication(bucket=1)
    with pytest.raises(TypeError, match="Communication.pipeline_scatter must be True or False"):
        jzero.Communication(pipeline_scatter="on")
    with pytest.raises(TypeError, match="comm must be a jzero.Communication, got dict"):
        _opt(comm={"bucket": True})


# Every keyword the configuration's restructure moved: its value, and the new spelling
# (the option object and how it is passed) the error must give.
MOVED = {
    "gather_quant": ("int8", "comm=jzero.Communication(gather_quant='int8')"),
    "grad_quant": ("int8", "comm=jzero.Communication(grad_quant='int8')"),
    "quant_block": (128, "comm=jzero.Communication(quant_block=128)"),
    "bucket": (True, "comm=jzero.Communication(bucket=True)"),
    "prefetch": (True, "comm=jzero.Communication(prefetch=True)"),
    "offload_chunk": (1024, "offload=jzero.Offload(optimizer='stream', chunk=1024)"),
    "param_specs": ({"w": P()}, "layout=jzero.Layout(param_specs={'w': P()})"),
    "rules": ((("mlp", None),), "layout=jzero.Layout(rules=(('mlp', None),))"),
    "min_shard_size": (8, "layout=jzero.Layout(min_shard_size=8)"),
}
OPTION_CLASSES = [
    jzero.Precision,
    jzero.Communication,
    jzero.Offload,
    jzero.Layout,
    jzero.StepOptions,
    jzero.ZeroConfig,
]


def _moved_cases():
    for cls in OPTION_CLASSES:
        fields = {f.name for f in dataclasses.fields(cls)}
        for name in MOVED.keys() - fields:
            yield pytest.param(cls, name, id=f"{cls.__name__}({name}=)")


@pytest.mark.parametrize(("cls", "name"), sorted(_moved_cases(), key=lambda p: p.id))
def test_an_option_class_names_where_a_moved_option_went(cls, name):
    """Each option class refuses every old keyword it does not take with a TypeError that
    names the new home, and the spelling it gives builds."""
    value, fix = MOVED[name]
    stage = {"stage": 3} if cls is jzero.ZeroConfig else {}
    with pytest.raises(TypeError) as error:
        cls(**stage, **{name: value})
    message = str(error.value)
    assert message.startswith(f"{cls.__name__}({name}={value!r}): {name} moved to jzero.")
    assert f"pass {fix} to " in message
    # The new spelling runs: a config at stage 3 takes it as the message writes it, and
    # the value lands in the new home.
    keyword, spelled = fix.split("=", 1)
    home = eval(spelled, {"jzero": jzero, "P": P})
    assert value in [getattr(home, f.name) for f in dataclasses.fields(home)]
    assert getattr(jzero.ZeroConfig(stage=3, **{keyword: home}), keyword) == home


def test_the_messages_say_what_to_pass_and_where():
    with pytest.raises(TypeError) as error:
        jzero.Precision(gather_quant="int8", quant_block=128)
    assert str(error.value) == (
        "Precision(gather_quant='int8', quant_block=128): gather_quant, quant_block moved to "
        "jzero.Communication: pass comm=jzero.Communication(gather_quant='int8', "
        "quant_block=128) to ZeroOptimizer or jzero.ZeroConfig."
    )
    with pytest.raises(TypeError) as error:
        jzero.ZeroConfig(stage=3, min_shard_size=8, offload_chunk=1024)
    assert str(error.value) == (
        "ZeroConfig(min_shard_size=8, offload_chunk=1024): min_shard_size moved to "
        "jzero.Layout: pass layout=jzero.Layout(min_shard_size=8) to jzero.ZeroConfig, or "
        "min_shard_size=8 to ZeroOptimizer itself; offload_chunk moved to jzero.Offload (as "
        "chunk): pass offload=jzero.Offload(optimizer='stream', chunk=1024) to ZeroOptimizer "
        "or jzero.ZeroConfig."
    )


def test_the_optimizer_and_its_step_name_where_their_old_keywords_went():
    with pytest.raises(TypeError) as error:
        _opt(stage=1, offload_chunk=1024)
    assert str(error.value) == (
        "ZeroOptimizer(offload_chunk=1024): offload_chunk moved to jzero.Offload (as chunk): "
        "pass offload=jzero.Offload(optimizer='stream', chunk=1024) to ZeroOptimizer or "
        "jzero.ZeroConfig."
    )
    with pytest.raises(TypeError) as error:
        _opt(stage=3).train_step(stacked_loss, bucket=True, grad_accum=2)
    assert str(error.value) == (
        "train_step(bucket=True): bucket moved to jzero.Communication: pass "
        "comm=jzero.Communication(bucket=True) to ZeroOptimizer or jzero.ZeroConfig."
    )
    state, _ = linen_state(3)
    with pytest.raises(TypeError, match=r"^train_step\(prefetch=True\): prefetch moved to"):
        state.train_step(lambda *a: 0.0, prefetch=True)
    # What the optimizer still takes as a keyword is no moved option there.
    assert _opt(stage=3, min_shard_size=8).config.layout == jzero.Layout(min_shard_size=8)


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_a_keyword_that_never_existed_is_pythons_own_type_error(cls):
    stage = {"stage": 3} if cls is jzero.ZeroConfig else {}
    with pytest.raises(TypeError) as error:
        cls(**stage, gather_quantization="int8")
    assert str(error.value) == (
        f"{cls.__name__}.__init__() got an unexpected keyword argument 'gather_quantization'"
    )


@pytest.mark.parametrize(
    "option",
    [
        jzero.Precision("bf16"),  # positionally, as before
        jzero.Communication(gather_quant="fp8", bucket=True),
        jzero.Offload(optimizer="stream", chunk=1024),
        jzero.Layout(param_specs={"w": P(None, "model")}, min_shard_size=8),
        jzero.StepOptions(grad_accum=2, axis_name="batch"),
        jzero.ZeroConfig(stage=3, comm=jzero.Communication(prefetch=True)),
    ],
    ids=lambda option: type(option).__name__,
)
def test_option_objects_still_replace_pickle_and_compare(option):
    """The check of old keywords wraps __init__ alone: replace() goes through it, pickling
    does not, and equality, hashing and the signature are the dataclass's."""
    assert pickle.loads(pickle.dumps(option)) == option
    assert hash(pickle.loads(pickle.dumps(option))) == hash(option)
    assert dataclasses.replace(option) == option
    fields = [f.name for f in dataclasses.fields(option) if f.init]
    assert list(inspect.signature(type(option)).parameters) == fields


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
