"""A state in the wrong memory is refused with an error naming the leaf and the fix.

The step refuses a state made with the other ``offload`` setting. ``check_state`` compares
every leaf's memory kind with its plan: in ``opt.full_state`` / ``full_params`` on the
arrays, and in the step at trace time (jit keys on memory kinds, so a moved leaf retraces
and is checked). Neither needs a compile. The fix the errors name, a checkpoint restored by
the other optimizer, is checked to train as single-device Optax.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, awkward_batches, awkward_loss, awkward_params, reference

import jzero

HOST = "pinned_host"
TX = optax.adam(1e-2)
BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


@functools.cache
def _opt(offload: str | None, precision: jzero.Precision = BF16) -> jzero.ZeroOptimizer:
    mesh = jzero.data_mesh()
    return jzero.ZeroOptimizer(
        TX, mesh, stage=2, min_shard_size=1, precision=precision, offload=offload
    )


@functools.cache
def _state(offload: str | None) -> jzero.ZeroState:
    return _opt(offload).init(awkward_params())


def _to(kind: str, tree):
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def _refusals(opt, state):
    """Each way ``state`` reaches ``check_state``: the step's trace, full_state, full_params."""
    step = opt.train_step(awkward_loss, donate=False)
    batch = awkward_batches(1)[0]
    return [
        lambda: step(state, batch),
        lambda: opt.full_state(state),
        lambda: opt.full_params(state),
    ]


def test_states_in_their_planned_memory_pass():
    for offload, opt_kind in [("optimizer", HOST), (None, "device")]:
        opt, state = _opt(offload), _state(offload)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.opt_state, state.master))}
        assert kinds == {opt_kind}
        opt.check_state(state, tx=True)
        opt.train_step(awkward_loss, donate=False).lower(state, awkward_batches(1)[0])


@pytest.mark.parametrize(("made", "used"), [(None, "optimizer"), ("optimizer", None)])
def test_state_of_the_other_offload_setting_is_refused(made, used):
    error = (
        f"state was made by an optimizer with offload={made!r}, but this optimizer has "
        f"offload={used!r}; create the state with this optimizer's init(), or move it over "
        "with a checkpoint: jzero.Checkpointer.restore(opt, ...) places every leaf where this "
        "optimizer's plan says."
    )
    step = _opt(used).train_step(awkward_loss, donate=False)
    with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
        step(_state(made), awkward_batches(1)[0])


@pytest.mark.parametrize(
    ("offload", "field", "kind", "why"),
    [  # restored or moved by hand into the other memory
        ("optimizer", "opt_state", "device", "the optimizer's leaves rest in host memory"),
        ("optimizer", "master", "device", "the optimizer's leaves rest in host memory"),
        ("optimizer", "params", HOST, "the optimizer's leaves rest in host memory"),
        (None, "opt_state", HOST, "nothing is offloaded (offload=None)"),
        (None, "master", HOST, "nothing is offloaded (offload=None)"),
    ],
)
def test_leaf_in_the_other_memory_is_named_with_the_fix(offload, field, kind, why):
    state = _state(offload)
    moved = state.replace(**{field: _to(kind, getattr(state, field))})
    path, _ = jax.tree_util.tree_flatten_with_path(getattr(state, field))[0][0]
    planned = "device" if kind == HOST else HOST
    error = (
        f"state.{field} leaf {jax.tree_util.keystr(path)} is in {kind!r} memory, but its plan "
        f"stores it in {planned!r} memory: {why}"
    )
    fix = (
        f"Put the leaf back, e.g. jax.device_put(x, x.sharding.with_memory_kind({planned!r})), "
        "or restore the state with jzero.Checkpointer.restore(opt, ...), which places every "
        "leaf as planned."
    )
    for call in _refusals(_opt(offload), moved):
        with pytest.raises(ValueError, match=f"^{re.escape(error)}.*{re.escape(fix)}"):
            call()


def test_moved_back_state_passes():
    state = _state("optimizer")
    moved = state.replace(opt_state=_to("device", state.opt_state))
    back = moved.replace(opt_state=_to(HOST, moved.opt_state))
    _opt("optimizer").check_state(back, tx=True)


def test_checkpoint_moves_a_state_to_the_other_offload_setting(tmp_path):
    """The fix the offload error names: save with one optimizer, restore with the other;
    the restored state rests where the restoring plan says and trains as plain Optax (fp32:
    the oracle's precision)."""
    params, batches = awkward_params(), awkward_batches(3)
    fp32 = jzero.Precision()
    ckpt = jzero.Checkpointer(tmp_path)
    ckpt.save(0, _opt(None, fp32).init(params), force=True)
    ckpt.wait()
    opt = _opt("optimizer", fp32)
    state = ckpt.restore(opt, params).state
    ckpt.close()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {HOST}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    step = opt.train_step(awkward_loss)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref = reference(TX, params, awkward_loss, batches)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6)
    full = opt.full_state(state)
    assert_tree_close(full.params, ref.params, rtol=1e-6, atol=1e-6)
    assert_tree_close(full.opt_state, ref.opt_state, rtol=1e-6, atol=1e-6)
