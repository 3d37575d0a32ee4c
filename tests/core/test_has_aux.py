"""``has_aux=True``: the loss returns ``(loss, aux)`` as for ``jax.value_and_grad``; the
step trains exactly as without aux and returns aux averaged over the global batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params, reference

import jzero


def loss_with_aux(params, batch):
    loss = awkward_loss(params, batch)
    rows = jnp.asarray(batch["x"].shape[0], jnp.int32)
    return loss, {"mse": loss, "x_mean": jnp.mean(batch["x"], axis=0), "rows": rows}


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_aux_is_the_global_batch_value_and_training_is_unchanged(stage, grad_accum):
    batches = awkward_batches(3)
    ref_params, _, ref_losses, _ = reference(
        optax.adam(1e-2), awkward_params(), awkward_loss, batches
    )
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=stage)
    state = opt.init(awkward_params())
    step = opt.train_step(loss_with_aux, has_aux=True, grad_accum=grad_accum)
    for batch, ref_loss in zip(batches, ref_losses):
        state, metrics = step(state, batch)
        aux = metrics["aux"]
        # floats: the mean over devices (and micro-batches) of per-slice means = the global
        # mean; integers: summed (a row count comes back as the global batch size)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
        np.testing.assert_allclose(aux["mse"], ref_loss, rtol=1e-6)
        np.testing.assert_allclose(aux["x_mean"], jnp.mean(batch["x"], axis=0), rtol=1e-5)
        assert aux["rows"].dtype == jnp.int32 and int(aux["rows"]) == 16
    got = opt.full_params(state)
    for k, want in ref_params.items():
        np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-6, err_msg=k)


def test_aux_with_model_state():
    """``with_model_state=True, has_aux=True``: ``loss_fn -> ((loss, aux), model_state)``."""
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=3)
    state = opt.init(awkward_params(), model_state={"calls": jnp.zeros((), jnp.int32)})

    def loss_fn(params, model_state, batch):
        loss, aux = loss_with_aux(params, batch)
        return (loss, aux), {"calls": model_state["calls"] + 1}

    step = opt.train_step(loss_fn, with_model_state=True, has_aux=True)
    state, metrics = step(state, awkward_batches(1)[0])
    assert int(metrics["aux"]["rows"]) == 16
    assert int(state.model_state["calls"]) == 1


def test_has_aux_loss_that_returns_a_scalar():
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=1)
    state = opt.init(awkward_params())
    with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return a pair \(loss, aux\)"):
        opt.train_step(awkward_loss, has_aux=True)(state, awkward_batches(1)[0])


def test_no_aux_key_without_has_aux():
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=2)
    _, metrics = opt.train_step(awkward_loss)(opt.init(awkward_params()), awkward_batches(1)[0])
    assert set(metrics) == {"loss", "grad_norm"}
    assert jax.tree.structure(metrics) == jax.tree.structure({"loss": 0, "grad_norm": 0})


class Tag:
    """Not a number."""


@pytest.mark.parametrize(
    "leaf, shown",
    [
        ("train", r"the str 'train'"),
        (np.array(["a", "b"]), r"an array of shape \(2,\) and dtype <U1"),
        (Tag(), r"a Tag"),
    ],
)
def test_an_aux_leaf_that_is_no_number_is_named(leaf, shown):
    """Strings (and other objects) in aux cannot be averaged over devices: the error names
    the leaf's path and the fix, before anything is traced further."""
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=2)
    state = opt.init(awkward_params())

    def loss_fn(params, batch):
        loss, aux = loss_with_aux(params, batch)
        return loss, {**aux, "info": {"split": leaf}}

    message = rf"aux leaf \['info'\]\['split'\] is {shown}; has_aux's aux may hold arrays and "
    message += r"numbers only.*keep strings and other Python objects outside loss_fn"
    step = opt.train_step(loss_fn, has_aux=True)
    with pytest.raises(TypeError, match=message):
        step(state, awkward_batches(1)[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # refused while tracing
    # Python numbers and numpy scalars are numbers: they pass as they did.
    numbers = lambda p, b: (awkward_loss(p, b), {"n": 3, "f": 0.5, "np": np.float32(2)})
    _, metrics = opt.train_step(numbers, has_aux=True)(state, awkward_batches(1)[0])
    assert int(metrics["aux"]["n"]) == 3 * 8 and float(metrics["aux"]["f"]) == 0.5
