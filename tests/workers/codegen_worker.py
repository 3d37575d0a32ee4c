"""tests/_models.py's scanned stack, its jzero stage-2 step compiled for 8 CPU devices
and (with JAX's CUDA plugin) for 8 compile-only H200s; prints what each compile's program
is (a hash of its optimised HLO text and its buffer assignment's sizes) and the parameters
two steps on the CPU train.

tests/project/test_test_setup.py runs it without the tests' code-generation flags
(tests/conftest.py) and compares it with the same compiles made under them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
from _models import stacked_batch, stacked_loss, stacked_params  # noqa: E402

import jzero  # noqa: E402


def _figures(mesh) -> dict:
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=2)
    state = jax.eval_shape(*opt.init_program(init_fn=stacked_params))
    data = jax.sharding.NamedSharding(mesh, jax.P("data"))
    batch = jax.tree.map(lambda x: x.update(sharding=data), jax.eval_shape(stacked_batch))
    compiled = opt.train_step(stacked_loss).lower(state, batch).compile()
    memory = compiled.memory_analysis()
    return {
        "hlo_sha1": hashlib.sha1(_program(compiled.as_text()).encode()).hexdigest(),
        "temp": memory.temp_size_in_bytes,
        "argument": memory.argument_size_in_bytes,
    }


def _program(text: str) -> str:
    """The module's computations without source locations (the Python stack that traced
    them differs between this script and a test)."""
    text = text[text.index("\n%") :]  # after the header and its file/stack tables
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def trained(mesh) -> list:
    """The parameters after two steps, and the loss."""
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=2)
    state, step = opt.init(stacked_params()), opt.train_step(stacked_loss)
    for _ in range(2):
        state, metrics = step(state, stacked_batch())
    return [*jax.tree.leaves(jax.device_get(opt.full_params(state))), metrics["loss"]]


def figures() -> dict:
    """The CPU compile's figures, and the GPU compile's where JAX's CUDA plugin is here."""
    out = {"cpu": _figures(jax.make_mesh((8,), ("data",)))}
    if any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in ("13", "12")):
        out["gpu"] = _figures(jzero.gpu_mesh("h200", devices=8))
    return out


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    out = figures()
    out["trained"] = [x.tolist() for x in trained(jax.make_mesh((8,), ("data",)))]
    print(json.dumps(out))
