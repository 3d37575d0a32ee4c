"""Small models and a single-device Optax oracle shared by the tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero

# Awkward shapes on 8 devices: primes (13x7, 7x5), vectors shorter than the device count,
# a scalar, and one leaf that divides evenly.
SHAPES = {"emb": (40, 13), "w1": (13, 7), "b1": (7,), "w2": (7, 5), "b2": (5,), "s": ()}


def awkward_params(seed: int = 0) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    params = {
        name: jax.random.normal(k, shape, jnp.float32) * 0.5
        for k, (name, shape) in zip(keys, SHAPES.items())
    }
    params["s"] = jnp.asarray(1.5, jnp.float32)
    return params


def awkward_loss(params, batch):
    params = jzero.gather(params)
    x_BxE = batch["x"] @ params["emb"]
    h_Bx7 = jnp.tanh(x_BxE @ params["w1"] + params["b1"])
    y_Bx5 = (h_Bx7 @ params["w2"]) * params["s"] + params["b2"]
    return jnp.mean((y_Bx5 - batch["y"]) ** 2)


def awkward_batches(steps: int, batch_size: int = 16, seed: int = 1) -> list[dict[str, jax.Array]]:
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(seed * 1000 + i))
        out.append(
            {
                "x": jax.random.normal(kx, (batch_size, 40), jnp.float32),
                "y": jax.random.normal(ky, (batch_size, 5), jnp.float32),
            }
        )
    return out


def stacked_params(layers: int = 4, width: int = 64, seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "layers": {
            "w": jax.random.normal(k1, (layers, width, width), jnp.float32) / np.sqrt(width),
            "b": jax.random.normal(k2, (layers, width), jnp.float32) * 0.1,
        }
    }


def stacked_loss(params, batch):
    """A scanned, rematerialised stack of tanh layers; each layer gathers its parameters."""

    @jax.checkpoint
    def layer(x_BxD, p):
        p = jzero.gather(p)
        return jnp.tanh(x_BxD @ p["w"] + p["b"]), None

    x_BxD, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def stacked_batch(width: int = 64, batch_size: int = 16) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(7))
    return {
        "x": jax.random.normal(kx, (batch_size, width), jnp.float32),
        "y": jax.random.normal(ky, (batch_size, width), jnp.float32),
    }


def regression_batches(steps: int, batch_size: int, width: int) -> list[dict[str, jax.Array]]:
    """``steps`` batches of ``x`` [batch_size, width] ~ N(0, 1) and targets ``y`` of the
    same shape ~ N(0, 0.25), for residual-MLP losses ``mean((f(x) - y)**2)``."""
    keys = jax.random.split(jax.random.key(3), steps)
    shape = (batch_size, width)
    return [
        {
            "x": jax.random.normal(k, shape, jnp.float32),
            "y": jax.random.normal(jax.random.fold_in(k, 1), shape, jnp.float32) * 0.5,
        }
        for k in keys
    ]


def random_pairs(n: int, batch: int, d_in: int, d_out: int, *, seed: int) -> list[dict]:
    """``n`` batches of ``x`` [batch, d_in] and ``y`` [batch, d_out], both ~ N(0, 1)."""
    keys = jax.random.split(jax.random.key(seed), n)
    return [
        {
            "x": jax.random.normal(k, (batch, d_in), jnp.float32),
            "y": jax.random.normal(jax.random.fold_in(k, 1), (batch, d_out), jnp.float32),
        }
        for k in keys
    ]


def make_tx(lr: float = 1e-2, *, eps: float = 1e-6, weight_decay: float | None = None):
    """Adam (AdamW with ``weight_decay``), the optimizer of the model-level parity tests.

    ``eps`` is large enough that Adam does not turn rounding noise in near-zero gradients
    into +-lr updates (docs/design.md, "Traps"): the comparison measures jzero, not that
    noise.
    """
    if weight_decay is None:
        return optax.adam(lr, eps=eps)
    return optax.adamw(lr, eps=eps, weight_decay=weight_decay)


class Reference(NamedTuple):
    """What plain single-device Optax ends with."""

    params: Any
    opt_state: Any
    losses: list[float]
    model_state: Any  # None unless the loss carries model state


def reference(
    tx: optax.GradientTransformation,
    params: Any,
    loss_fn: Callable[..., Any],
    batches: list[Any],
    *,
    model_state: Any = None,
    groups: int = 1,
) -> Reference:
    """Plain single-device Optax on the same data: the oracle.

    ``loss_fn(params, batch) -> loss``; with ``model_state``, ``loss_fn(params, model_state,
    batch) -> (loss, model_state)``, evaluated on ``groups`` equal slices of each batch (as
    ``groups`` devices would: the mean of their losses; the new state is the mean of floats
    and the max of integers over the slices, as jzero makes it agree).
    """
    device = jax.devices()[0]
    params = jax.device_put(params, device)

    def grouped(params, model_state, batch):
        if model_state is None:
            return loss_fn(params, batch), None
        split = jax.tree.map(lambda x: x.reshape(groups, -1, *x.shape[1:]), batch)
        losses, states = jax.vmap(loss_fn, in_axes=(None, None, 0))(params, model_state, split)
        agree = lambda s: s.mean(0) if jnp.issubdtype(s.dtype, jnp.inexact) else s.max(0)
        return losses.mean(), jax.tree.map(agree, states)

    @jax.jit
    def step(params, opt_state, model_state, batch):
        (loss, model_state), grads = jax.value_and_grad(grouped, has_aux=True)(
            params, model_state, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, model_state, loss = step(
            params, opt_state, model_state, jax.device_put(batch, device)
        )
        losses.append(float(loss))
    return Reference(params, opt_state, losses, model_state)


def run_steps(step: Callable, state: Any, batches: list[Any]) -> tuple[Any, list[float]]:
    """``step`` over ``batches`` from ``state``: the last state and every step's loss."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_trains_as(ref: Reference, step: Callable, state: Any, full: Callable, batches) -> None:
    """``step`` over ``batches`` agrees with single-device Optax (``ref``) to fp32
    rounding: every loss, and the parameters at the end (``full(state)``, whole)."""
    state, losses = run_steps(step, state, batches)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(full(state)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def assert_tree_close(got: Any, want: Any, *, rtol: float, atol: float) -> None:
    """Leaf by leaf (in tree order, so e.g. a pure dict matches an ``nnx.State``): the same
    shapes and dtypes, values close."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)


def _labels(params):
    return {k: ("freeze" if k == "emb" else "train") for k in params}


def _decay_mask(params):
    return {k: v.ndim == 2 for k, v in params.items()}


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "masked": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.1), _decay_mask), optax.adam(1e-2)
    ),
    "multi_transform_frozen": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "freeze": optax.set_to_zero()}, _labels
    ),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.01
    ),
}


# One step from the same state, fp32: the distributed step sums the gradient in another
# order (per-device partial sums, then a psum or reduce-scatter), a few ulps of the terms
# summed. Where the state holds a gradient element itself (SGD's momentum trace, MultiSteps'
# accumulator), its error is absolute: up to 1.13e-6 in one step, at every stage and in plain
# data parallelism alike, on a CPU with AVX-512 (XLA:CPU vectorises the single-device
# reduction differently; 2.1e-7 with --xla_cpu_max_isa=AVX2), over every optimizer and stage
# of tests/core/test_parity.py and the user's step.
STEP_RTOL, STEP_ATOL = 1e-6, 2e-6


class Trajectory(NamedTuple):
    """A run's state gathered whole on one device, ``(params, opt_state)`` before each step
    and after the last, and each step's loss."""

    wholes: list[tuple[Any, Any]]
    losses: list[Any]


def record(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    whole: Callable[[Any], tuple[Any, Any]],
    batches: list[Any],
) -> tuple[Any, Trajectory]:
    """``step(state, batch) -> (state, loss)`` over ``batches`` from ``state``: the last state
    and the trajectory, each state gathered by ``whole(state) -> (params, opt_state)``."""
    # Through the host: a gathered array may be typed with the run's (Explicit) mesh.
    on_one_device = lambda state: jax.device_put(jax.device_get(whole(state)), jax.devices()[0])
    wholes, losses = [on_one_device(state)], []
    for batch in batches:
        state, loss = step(state, batch)
        wholes.append(on_one_device(state))
        losses.append(loss)
    return state, Trajectory(wholes, losses)


def assert_each_step_is_optax(
    tx: optax.GradientTransformation,
    loss_fn: Callable[..., Any],
    trajectory: Trajectory,
    batches: list[Any],
) -> None:
    """Each step of a run is one step of plain single-device Optax from the same state.

    The run must start from ``tx.init``'s state. Then, from the run's own state before each
    step, Optax's step (``tx`` over ``loss_fn``'s gradient) on the same batch on one device
    must give the run's loss, parameters and optimizer state after it, to fp32 rounding:
    ``STEP_RTOL`` and ``STEP_ATOL``. Rounding cannot accumulate from step to step, so the
    bound is one step's at any length, for every optimizer alike.
    """
    device, wholes = jax.devices()[0], trajectory.wholes
    optax_step = jax.jit(functools.partial(_optax_step, tx, loss_fn))
    assert_tree_close(wholes[0][1], tx.init(wholes[0][0]), rtol=STEP_RTOL, atol=STEP_ATOL)
    for i, batch in enumerate(batches):
        params, opt_state, loss = optax_step(*wholes[i], jax.device_put(batch, device))
        try:
            np.testing.assert_allclose(trajectory.losses[i], loss, rtol=STEP_RTOL, atol=STEP_ATOL)
            assert jax.tree.structure(wholes[i + 1]) == jax.tree.structure((params, opt_state))
            assert_tree_close(wholes[i + 1], (params, opt_state), rtol=STEP_RTOL, atol=STEP_ATOL)
        except AssertionError as error:
            error.add_note(f"at step {i} of {len(batches)}")
            raise


def _optax_step(tx, loss_fn, params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
