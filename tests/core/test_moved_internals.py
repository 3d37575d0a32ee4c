"""A JAX release that moves an internal jzero reads costs memory, with a warning, or is
refused with an error that names it; it never stops a step deep inside a trace.

Each test simulates one move on the installed JAX -- a primitive's parameter renamed (as
jax 0.11 renamed scan's ``num_consts``), a primitive missing (as ``closed_call`` became
``eval_jaxpr``), a private function gone, ``compute_on`` with another signature (as in jax
0.11.1) -- and checks, for each feature that reads internals: the step still equals
single-device Optax (a fallback) or the optimizer / step refuses naming the internal and
the fix (no exact fallback).
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import assert_tree_close, reference, regression_batches

import jzero
from jzero.core.offload import chunks
from jzero.core.offload.split import split_update
from jzero.internal import coordination, host_compute, interpret, moved, primitives, vmap_axes
from jzero.internal.equation import Equation
from jzero.internal.moved import InternalMoved, InternalMovedWarning

L, D, H, B, STEPS = 3, 16, 32, 16, 2
TX = lambda: optax.adam(1e-2, eps=1e-4)  # eps above the gradients' rounding noise


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(moved, "_WARNED", set())  # each test sees its own first warning


def rename_param(monkeypatch, primitive: str | tuple[str, ...], old: str, new: str) -> None:
    """jzero reads every equation of ``primitive`` (a name or names) with its parameter
    ``old`` named ``new``, as after a JAX release that renamed it (JAX itself still binds
    it by its own name)."""
    names = (primitive,) if isinstance(primitive, str) else primitive
    own = Equation.params

    def renamed(self):
        params = own.fget(self)
        if self.jaxpr_eqn.primitive.name in names and old in params:
            params = {(new if k == old else k): v for k, v in params.items()}
        return params

    monkeypatch.setattr(Equation, "params", property(renamed))


def _params(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "layers": {
            "w1": jax.random.normal(k1, (L, D, H), jnp.float32) / 4,
            "w2": jax.random.normal(k2, (L, H, D), jnp.float32) / 8,
        }
    }


def _mlp(p, x_BxD):
    return x_BxD + jnp.tanh(x_BxD @ p["w1"]) @ p["w2"]


def scan_loss(params, batch):
    x_BxD, _ = jax.lax.scan(lambda x, p: (_mlp(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def unrolled_params() -> dict:
    stacked = _params()["layers"]
    return {"blocks": [{"w1": stacked["w1"][i], "w2": stacked["w2"][i]} for i in range(L)]}


def unrolled_loss(params, batch):
    x_BxD = batch["x"]
    for p in params["blocks"]:
        x_BxD = _mlp(p, x_BxD)
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def _train(opt, params, loss_fn, **step_options):
    state, step = opt.init(params), opt.train_step(loss_fn, **step_options)
    losses = []
    for batch in regression_batches(STEPS, B, D):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt.full_params(state), losses


def _assert_optax(opt, params, loss_fn, rtol=1e-6, tx=TX, **step_options):
    got, losses = _train(opt, params, loss_fn, **step_options)
    ref = reference(tx(), params, loss_fn, regression_batches(STEPS, B, D))
    assert_tree_close(got, ref.params, rtol=rtol, atol=1e-6)
    assert losses == pytest.approx(ref.losses, rel=rtol)


def _stage3(**kwargs):
    return jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=3, min_shard_size=1, **kwargs)


# Default per-layer gathering, prefetch and found layers: gather the whole model instead.


@pytest.mark.parametrize("prefetch", [False, True], ids=["per_layer", "prefetch"])
def test_scan_parameters_renamed_gather_the_whole_model_and_equal_optax(monkeypatch, prefetch):
    rename_param(monkeypatch, "scan", "ft_in", "flat_trees_in")
    opt = _stage3(comm=jzero.Communication(prefetch=prefetch))
    with pytest.warns(InternalMovedWarning, match=r"scan's parameter 'ft_in'") as seen:
        _assert_optax(opt, _params(), scan_loss)
    text = str(seen[0].message)
    assert jax.__version__ in text and "gathered at the start" in text
    whole = 4 * L * 2 * D * H  # every layer's fp32 weights, gathered
    assert f"{whole:,} bytes" in text
    assert ("prefetch" in text) == prefetch


def test_found_layers_whose_cut_cannot_be_read_gather_the_whole_model(monkeypatch):
    def moved_aval(v):
        raise InternalMoved("Var.aval (a jaxpr variable's shape and dtype)")

    monkeypatch.setattr(interpret, "_nbytes", moved_aval)
    policy = jax.checkpoint_policies.nothing_saveable
    with pytest.warns(InternalMovedWarning, match=r"Var\.aval"):
        _assert_optax(_stage3(), unrolled_params(), unrolled_loss, remat_policy=policy)


def test_a_missing_primitive_is_named_when_the_optimizer_is_built(monkeypatch):
    scan_p = next(p for p in primitives._KINDS if p.name == "scan")
    monkeypatch.delitem(primitives._KINDS, scan_p)
    monkeypatch.setattr(primitives, "MISSING", ["scan_p"])
    with pytest.warns(InternalMovedWarning, match=r"primitives\.scan_p.*bound whole"):
        opt = _stage3()
    _assert_optax(opt, _params(), scan_loss)  # the scan bound whole, its stacks gathered


# Batch-axis aliases and vmap-bound axes: no exact fallback, a clear refusal.


def _alias_loss(params, batch):
    x_BxD = batch["x"] - jax.lax.pmean(batch["x"].mean(0), "batch")
    return scan_loss(params, {"x": x_BxD, "y": batch["y"]})


def test_an_alias_over_a_collective_whose_axes_moved_is_refused(monkeypatch):
    psums = ("psum", "psum_invariant")  # the latter inside shard_map's checks
    rename_param(monkeypatch, psums, "axes", "axis_names")
    step = _stage3().train_step(_alias_loss, axis_name="batch")
    with pytest.raises(
        RuntimeError, match=r"axis_name=\('batch',\).*psum\w*'s axes parameter.*'data'"
    ):
        step(_stage3().init(_params()), regression_batches(1, B, D)[0])


def test_a_vmap_bound_axis_without_the_unchecked_trace_is_refused(monkeypatch):
    monkeypatch.setattr(vmap_axes, "_config", types.SimpleNamespace())

    def loss_fn(params, batch):
        def one(x_D):
            return x_D - jax.lax.pmean(x_D, "v")

        x_BxD = jax.vmap(one, axis_name="v")(batch["x"])
        return scan_loss(params, {"x": x_BxD, "y": batch["y"]})

    opt = _stage3()
    with pytest.raises(RuntimeError, match=r"own jax\.vmap axis.*_check_vma.*outside the vmap"):
        opt.train_step(loss_fn)(opt.init(_params()), regression_batches(1, B, D)[0])


# The offloaded update: one bucket instead of one per leaf; whole leaves instead of chunks.


def _offload_params() -> dict:
    k = jax.random.split(jax.random.key(2), 3)
    return {"a": jax.random.normal(k[0], (D, H)), "b": jax.random.normal(k[1], (H,)),
            "c": jax.random.normal(k[2], (H, D)) / 4}  # fmt: skip


def _offload_loss(p, batch):
    h_BxH = jnp.tanh(batch["x"] @ p["a"] + p["b"])
    return jnp.mean((h_BxH @ p["c"] - batch["y"]) ** 2)


@pytest.mark.parametrize("mode", ["stream", "host"])
def test_a_split_that_cannot_inline_calls_runs_the_update_whole(monkeypatch, mode):
    rename_param(monkeypatch, "jit", "jaxpr", "body")  # Adam's bias correction is a jit
    opt = _stage3(offload=jzero.Offload(optimizer=mode))
    with pytest.warns(InternalMovedWarning) as warned:
        _assert_optax(opt, _offload_params(), _offload_loss)
    said = [str(w.message) for w in warned]
    assert any(re.search(r"jit's parameter 'jaxpr'.*one bucket", m) for m in said), said
    # the matrix optimizers' reading of the update falls back too, every leaf as stored
    assert any(m.startswith("matrix optimizers on whole matrices") for m in said), said


def test_an_update_whose_calls_cannot_be_read_keeps_every_leaf_as_stored(monkeypatch):
    rename_param(monkeypatch, "jit", "jaxpr", "body")
    opt = jzero.ZeroOptimizer(optax.contrib.muon(1e-2), jzero.data_mesh(), stage=1)
    with pytest.warns(InternalMovedWarning, match=r"matrix optimizers on whole matrices: JAX"):
        plan = opt.plan(_params())
    assert plan.matrices is None and "?" in plan.describe()


def test_a_missing_elementwise_primitive_streams_whole_leaves(monkeypatch):
    tx = TX()
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=3, min_shard_size=1,
                              offload=jzero.Offload(optimizer="stream", chunk=64))  # fmt: skip
    plan = opt.init(_offload_params()).plan
    chunked = lambda: [chunks.cuts(split_update(tx, plan), b, plan, 64) is not None
                       for b in split_update(tx, plan).buckets]  # fmt: skip
    assert chunked() == [True, False, True]  # a, c: 512 elements in chunks of 64; b: 32
    sqrt_p = next(p for p in primitives._KINDS if p.name == "sqrt")
    monkeypatch.delitem(primitives._KINDS, sqrt_p)  # Adam's sqrt no longer elementwise
    monkeypatch.setattr(primitives, "MISSING", ["sqrt_p"])
    split_update.cache_clear()
    with pytest.warns(InternalMovedWarning, match=r"primitives\.sqrt_p.*not split or chunked"):
        opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=3, min_shard_size=1,
                                  offload=jzero.Offload(optimizer="stream", chunk=64))  # fmt: skip
    assert chunked() == [False, False, False]  # whole leaves
    _assert_optax(opt, _offload_params(), _offload_loss)
    split_update.cache_clear()


def test_a_compute_on_of_another_form_refuses_the_host_step_when_built(monkeypatch):
    def old_compute_on(compute_type):  # jax <= 0.11.0's context-manager form
        del compute_type

    monkeypatch.setattr(host_compute, "_compute_on", lambda: old_compute_on)
    with pytest.raises(RuntimeError, match=re.escape(f"JAX {jax.__version__}") + r".*compute_on"):
        _stage3(offload=jzero.Offload(optimizer="host"))
    with pytest.raises(RuntimeError, match=r"Offload\(optimizer='stream'\)"):
        _stage3(offload=jzero.Offload(optimizer="host"))
    _stage3(offload=jzero.Offload(optimizer="stream"))  # the streamed mode needs none


# Coordination: the watchdog goes on without naming the stalled peer.


def test_a_moved_coordination_client_is_unavailable_with_a_warning(monkeypatch):
    monkeypatch.setattr(coordination, "_distributed", types.SimpleNamespace())
    with pytest.warns(InternalMovedWarning, match=r"global_state\.client.*cannot name"):
        assert coordination.is_available() is False
    assert coordination.is_available() is False  # warned once
