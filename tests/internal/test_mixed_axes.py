"""The axes an update mixes, read from its jaxpr (jzero/internal/mixed_axes.py), and the
per-leaf batching of same-shaped leaves (jzero/internal/leaf_batching.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jzero.internal.leaf_batching import plan_batching, run_batching
from jzero.internal.mixed_axes import mixed_axes_of

X = jnp.ones((4, 8))


@pytest.mark.parametrize(
    ("fn", "mixed", "reduced"),
    [
        (lambda x: x * 2 + jnp.sqrt(jnp.abs(x)), set(), set()),  # elementwise
        (lambda x: x / jnp.linalg.norm(x), set(), {0, 1}),  # a norm reduces
        (lambda x: x.mean(1, keepdims=True) * x, set(), {1}),  # Adafactor-like row means
        (lambda x: x @ x.T @ x, {0, 1}, set()),  # Newton-Schulz
        (lambda x: x.T @ jnp.ones((4, 3)), {0}, set()),  # contracts axis 0 only
        (lambda x: x.reshape(32), {0, 1}, set()),  # merges two axes
        (lambda x: x.reshape(4, 2, 4), {1}, set()),  # splits axis 1
        (lambda x: jnp.cumsum(x, axis=1), {1}, set()),
        (lambda x: jnp.linalg.qr(x.T)[0], {0, 1}, set()),  # unknown to the pass: all
        (lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y @ y.T @ y, x), {0, 1}, set()),
    ],
)
def test_each_rule(fn, mixed, reduced):
    found = mixed_axes_of(fn, X)
    assert found.mixed[0] == frozenset(mixed)
    assert reduced <= found.reduced[0]


def test_a_vmapped_batch_axis_is_not_mixed():
    stack = jnp.ones((3, 4, 8))
    found = mixed_axes_of(jax.vmap(lambda x: x @ x.T @ x), stack)
    assert found.mixed[0] == frozenset({1, 2})


def test_muon_with_dimension_numbers_mixes_the_matrix_axes_only():
    params = {"w": jnp.ones((4, 8, 16)), "b": jnp.ones(16)}
    dims = {"w": optax.contrib.MuonDimensionNumbers(1, 2), "b": None}
    tx = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    found = mixed_axes_of(tx.update, params, tx.init(params), params)
    grads = dict(zip(["b", "w"], found.mixed[:2]))  # dict leaves in key order
    assert grads == {"b": frozenset(), "w": frozenset({1, 2})}


def test_same_shaped_leaves_run_as_one_stack_with_the_same_numbers():
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (8, 16)) for i in range(3)}
    grads = jax.tree.map(jnp.sin, params)
    tx = optax.contrib.muon(1e-2)
    state = tx.init(params)
    flat, treedef = jax.tree.flatten((grads, state, params))
    n, m = 3, len(jax.tree.leaves(state))
    owners = {2: 0, 3: 1, 4: 2}  # the momentum of each w, after Adam's and Muon's counts
    roles = [[i, n + j, n + m + i] for j, i in owners.items()]

    def update(*a):
        return jax.tree.leaves(tx.update(*jax.tree.unflatten(treedef, a)))

    batching = plan_batching(update, flat, [roles])
    assert batching is not None and any(p.batched for p in batching.private.values())
    stacked = []
    stack = lambda b, values: stacked.append(len(values)) or jnp.stack(values)
    got = run_batching(batching, flat, stack, lambda b, x: list(x))
    assert stacked and set(stacked) == {3}
    for a, b in zip(got, update(*flat)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_leaves_treated_differently_are_not_stacked():
    params = {"a": jnp.ones((8, 16)), "b": jnp.ones((8, 16))}
    tx = optax.chain(optax.masked(optax.add_decayed_weights(0.1), {"a": True, "b": False}),
                     optax.contrib.muon(1e-2))  # fmt: skip
    state = tx.init(params)
    flat, treedef = jax.tree.flatten((params, state, params))
    n, m = 2, len(jax.tree.leaves(state))
    update = lambda *a: jax.tree.leaves(tx.update(*jax.tree.unflatten(treedef, a)))
    assert plan_batching(update, flat, [[[0, n + m], [1, n + m + 1]]]) is None
