"""Muon under quantized collectives (ZeRO++'s qgZ and qwZ) is single-device Optax's Muon
on what the quantized collectives deliver. With quantized gradients, Muon's update is
Optax's of the very gradient ``sgd(1.0)`` receives from the same state and batch (the
quantization is deterministic: each element's rounding is hashed from its bits, position
and device); with quantized stage-3 gathers, of the gradient at the dequantized
parameters. Both hold to fp32 rounding, whether the update runs along an owner axis
(the scanned stack) or in stacks of same-shaped matrices (the unrolled layers), so the
whole-matrix update adds no error of its own to the quantization's (bounded in
test_quantized_grads.py and test_quantized_gather.py)."""

from __future__ import annotations

import _models
import jax
import optax
import pytest
from _matrices import OPTIMIZERS, batches, model
from _quantized_gather import dequantized

import jzero

ROUNDING = {"rtol": 1e-5, "atol": 1e-6}  # fp32 rounding of w - g, then of Newton-Schulz


def _first_step(tx, stage: int, scanned: bool, comm: jzero.Communication, batch: dict):
    """(state before, parameters before, parameters after) of one jzero step."""
    params, loss = model(scanned)
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage, comm=comm, min_shard_size=1)
    state = opt.init(params)
    before = opt.full_params(state)
    after, _ = opt.train_step(loss, donate=False)(state, batch)
    return state, before, opt.full_params(after)


def _optax(name: str, grads: dict, params: dict) -> dict:
    tx = OPTIMIZERS[name][0]()
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


@pytest.mark.parametrize(
    ("name", "stage", "dtype"),
    [("muon", 1, "int8"), ("muon", 3, "int4"), ("muon_scanned", 2, "int8")],
)
def test_muon_on_quantized_gradients_is_optax_on_the_gradient_sgd_receives(name, stage, dtype):
    scanned = OPTIMIZERS[name][1]
    comm, batch = jzero.Communication(grad_quant=dtype), batches(1, 64)[0]
    _, params, sgd = _first_step(optax.sgd(1.0), stage, scanned, comm, batch)
    received = jax.tree.map(lambda w, w1: w - w1, params, sgd)
    _, _, got = _first_step(OPTIMIZERS[name][0](), stage, scanned, comm, batch)
    _models.assert_tree_close(got, _optax(name, received, params), **ROUNDING)
    exact = jax.grad(model(scanned)[1])(params, batch)
    moved = jax.tree.map(lambda g, e: float(abs(g - e).max()), received, exact)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the quantization is really there


@pytest.mark.parametrize("name", ["muon", "muon_scanned"])
def test_muon_with_quantized_gathers_is_optax_at_the_dequantized_params(name):
    scanned = OPTIMIZERS[name][1]
    comm, batch = jzero.Communication(gather_quant="int8"), batches(1, 64)[0]
    state, params, got = _first_step(OPTIMIZERS[name][0](), 3, scanned, comm, batch)
    w_hat = dequantized(state, comm.gather_quantizer, per_layer=lambda _: scanned)
    grads = jax.grad(model(scanned)[1])(w_hat, batch)
    _models.assert_tree_close(got, _optax(name, grads, params), **ROUNDING)
    moved = jax.tree.map(lambda w, h: float(abs(w - h).max()), params, w_hat)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the quantization is really there
