"""A jzero step over a scanned stack, compiled for 8 CPU devices and (with JAX's CUDA
plugin) for 8 compile-only H200s; prints what each compile's program is (a hash of its
optimised HLO text and its buffer assignment's sizes) and the parameters two steps on the
CPU train.

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
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402

LAYERS, D = 4, 64


def _loss(params, batch):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, batch["x"], params["stack"])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def _figures(mesh) -> dict:
    abstract = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params = {"stack": abstract((LAYERS, D, D)), "out": abstract((D, 4))}
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=2)
    state = jax.eval_shape(*opt.init_program(init_fn=lambda: jax.tree.map(jnp.ones_like, params)))
    data = jax.sharding.NamedSharding(mesh, jax.P("data"))
    batch = {"x": (64, D), "y": (64, 4)}
    batch = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=data) for k, s in batch.items()}
    compiled = opt.train_step(_loss).lower(state, batch).compile()
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
    """The parameters after two steps from random ones, on random data, and the loss."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"stack": jax.random.normal(k1, (LAYERS, D, D)) / D**0.5,
              "out": jax.random.normal(k2, (D, 4)) / D**0.5}  # fmt: skip
    batch = {"x": jax.random.normal(k3, (64, D)), "y": jax.random.normal(k4, (64, 4))}
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=2)
    state, step = opt.init(params), opt.train_step(_loss)
    for _ in range(2):
        state, metrics = step(state, batch)
    return [*jax.tree.leaves(jax.device_get(opt.full_params(state))), metrics["loss"]]


def figures() -> dict:
    """The CPU compile's figures, and the GPU compile's where JAX's CUDA plugin is here."""
    out = {"cpu": _figures(jax.make_mesh((8,), ("data",)))}
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:
        out["gpu"] = _figures(jzero.gpu_mesh("h200", devices=8))
    return out


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    out = figures()
    out["trained"] = [x.tolist() for x in trained(jax.make_mesh((8,), ("data",)))]
    print(json.dumps(out))
