"""The subprocess half of tests/core/test_consumed_state.py: every entry point that reads a
state, called on a state that a donating train step consumed, in a fresh interpreter, so
that a segfault fails the test instead of killing pytest.

For each entry point the program it runs is compiled first, on a live state of the same
plan (jaxlib 0.10.2 segfaults when a compiled program is handed a deleted buffer, e.g.
``opt.full_params`` of a consumed state); then another state of that plan is consumed by a
step and the entry point is called on it. ``python tests/workers/consumed_state_worker.py`` prints
one JSON object: ``{entry point: [exception type or "returned", message]}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _flax_models import NNXMLP, D, LinenMLP  # noqa: E402
from _models import awkward_batches, awkward_loss, awkward_params  # noqa: E402
from flax import nnx  # noqa: E402

import jzero  # noqa: E402


def mlp_batch() -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (16, D)), "y": jax.random.normal(ky, (16, D))}


def core() -> tuple[Callable[[], Any], Any, Any, Any]:
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)
    step = opt.train_step(awkward_loss)
    return (lambda: opt.init(awkward_params())), step, awkward_batches(1)[0], opt


def linen() -> tuple[Callable[[], Any], Any, Any, Any]:
    variables = LinenMLP().init(jax.random.key(0), jnp.zeros((1, D)))
    make = lambda: jzero.linen.TrainState.create(
        apply_fn=LinenMLP().apply,
        variables=variables,
        tx=optax.adam(1e-2),
        mesh=jzero.data_mesh(),
        stage=3,
    )

    def loss_fn(params, batch):
        pred = LinenMLP().apply({"params": jzero.gather(params)}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    return make, make().train_step(loss_fn), mlp_batch(), None


def nnx_kind() -> tuple[Callable[[], Any], Any, Any, Any]:
    make = lambda: jzero.nnx.TrainState.create(
        NNXMLP(nnx.Rngs(0)), tx=optax.adam(1e-2), mesh=jzero.data_mesh(), stage=3
    )
    loss_fn = lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return make, make().train_step(loss_fn), mlp_batch(), None


# entry point -> (kind, call(state, step, batch, opt))
ENTRIES: dict[str, tuple[Callable, Callable[[Any, Any, Any, Any], Any]]] = {
    "ZeroOptimizer.full_params": (core, lambda s, st, b, opt: opt.full_params(s)),
    "ZeroOptimizer.full_state": (core, lambda s, st, b, opt: opt.full_state(s)),
    "TrainStep.__call__": (core, lambda s, st, b, opt: st(s, b)),
    "TrainStep.lower": (core, lambda s, st, b, opt: st.lower(s, b).compile()),
    "jzero.report": (core, lambda s, st, b, opt: jzero.report(st, s, b)),
    "linen.TrainState.params": (linen, lambda s, st, b, opt: s.params),
    "linen.TrainState.variables": (linen, lambda s, st, b, opt: s.variables),
    "linen step": (linen, lambda s, st, b, opt: st(s, b)),
    "linen step.lower": (linen, lambda s, st, b, opt: st.lower(s, b).compile()),
    "jzero.report (linen)": (linen, lambda s, st, b, opt: jzero.report(st, s.zero, b)),
    "nnx.TrainState.model": (nnx_kind, lambda s, st, b, opt: s.model()),
    "nnx step": (nnx_kind, lambda s, st, b, opt: st(s, b)),
    "nnx step.lower": (nnx_kind, lambda s, st, b, opt: st.lower(s, b).compile()),
}


def main() -> None:
    kinds = {kind: kind() for kind in {kind for kind, _ in ENTRIES.values()}}
    outcomes = {}
    for name, (kind, call) in ENTRIES.items():
        make, step, batch, opt = kinds[kind]
        call(make(), step, batch, opt)  # compiles what the entry point runs, on a live state
        consumed = make()
        step(consumed, batch)  # donates its buffers
        try:
            call(consumed, step, batch, opt)
            outcomes[name] = ["returned", ""]
        except Exception as e:  # the test checks the type and the message
            outcomes[name] = [type(e).__name__, str(e)]
    print(json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    main()
