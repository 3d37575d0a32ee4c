"""The host optimizer step (``Offload(optimizer="host")``) compiles for a GPU.

On the lent H200 (2026-12-01, jax 0.11.2) XLA's GPU compiler refused the host step of
small models that the CPU tests train bitwise, two ways:

- a model with a dense layer: the gradient of ``x @ w`` comes out column-major, and
  layout assignment gave the host computation's parameter that layout while its caller
  passed it row-major ("expects the async shape at index {0} to be a tuple with shapes
  that match..."). jzero now copies gradients down row-major (``core/host_memory.py``);
- an update that runs whole on the host (one parameter leaf, or an Optax chain that does
  not split per leaf) with Adam's count: a value returned by the host computation and
  also read inside it failed XLA's clean-up of memory annotations ("instruction
  device_put.12 is live and cannot be removed"). The host computation's results now
  leave it through an ``optimization_barrier``.

No GPU is needed to see either: the step is lowered here for ``cuda`` on one CPU device
(which, unlike compile-only GPUs, has ``pinned_host`` memory) and compiled by XLA's GPU
compiler for one compile-only H200 (``jzero.internal.cross_compile``), which refused
these programs exactly as the H200 did. The compiled program's host bytes are then the
offloaded state's, to the byte.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from _paths import GPU_PLUGIN

import jzero
from jzero.internal.cross_compile import compile_for

pytest.importorskip(
    GPU_PLUGIN,
    reason="needs JAX's CUDA plugin: pip install 'jzero[gpu-compile]' "
    "'jax-cuda12-plugin==V' 'jax-cuda12-pjrt==V' (V = jaxlib's version)",
)

SHAPE = (512, 512)


def _loss(kind: str):
    def loss(params, batch):
        x = batch["x"]
        if kind == "dense":  # the gradient x.T @ g: column-major
            return sum(jnp.mean((x @ w) ** 2) for w in jax.tree.leaves(params))
        return sum(jnp.mean((w * x[0, 0]) ** 2) for w in jax.tree.leaves(params))

    return loss


def _compiled(leaves: int, kind: str, stage: int, tx=None, **offload):
    """The host step of ``leaves`` [512, 512] fp32 leaves, lowered for ``cuda`` on one CPU
    device and compiled for one compile-only H200: ``(optimizer, state, memory stats)``."""
    mesh = jzero.data_mesh(jax.devices()[:1])
    opt = jzero.ZeroOptimizer(
        tx or optax.adamw(1e-3), mesh, stage=stage,
        offload=jzero.Offload(optimizer="host", **offload),
    )  # fmt: skip
    state = opt.init({f"w{i}": jnp.full(SHAPE, 0.01, jnp.float32) for i in range(leaves)})
    batch = {"x": jnp.ones((8, SHAPE[0]), jnp.float32)}
    text = opt.train_step(_loss(kind)).lower(state, batch, platforms=("cuda",)).as_text()
    gpu = jzero.gpu_mesh("h200", devices=1)
    return opt, state, compile_for(text, list(gpu.devices.flat)).get_compiled_memory_stats()


def _host_bytes(state) -> int:
    """The bytes of ``state`` that rest in host memory (the offloaded Optax state and master
    weights)."""
    return sum(
        math.prod(x.shape) * x.dtype.itemsize
        for x in jax.tree.leaves(state)
        if x.sharding.memory_kind == "pinned_host"
    )


@pytest.mark.every_case  # in CI: each case failed on the H200 before the fix (seconds each)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("leaves, kind", [(1, "scale"), (1, "dense"), (2, "dense")])
def test_the_host_step_of_a_dense_or_one_leaf_model_compiles_for_a_gpu(leaves, kind, stage):
    _, state, stats = _compiled(leaves, kind, stage)
    # AdamW's two moments per leaf and its count rest on the host, read and written there.
    assert _host_bytes(state) == leaves * 2 * math.prod(SHAPE) * 4 + 4
    assert stats.host_argument_size_in_bytes == _host_bytes(state)
    assert stats.host_output_size_in_bytes == _host_bytes(state)
    assert stats.host_alias_size_in_bytes == _host_bytes(state)  # updated in place


@pytest.mark.parametrize(
    "offload", [{"params": True}, {"ratio": 0.5}], ids=["params", "ratio_half"]
)
def test_the_host_step_with_offloaded_params_or_half_the_state_compiles_for_a_gpu(offload):
    _, state, stats = _compiled(2, "dense", 3, **offload)
    assert stats.host_argument_size_in_bytes == _host_bytes(state) > 0


def test_an_update_that_does_not_split_compiles_for_a_gpu():
    # A clip of Adam's *updates* reads every leaf's moments: the whole update is one host
    # computation, Adam's count included.
    tx = optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(1.0), optax.scale(-1e-3))
    _, state, stats = _compiled(2, "dense", 3, tx=tx)
    assert stats.host_argument_size_in_bytes == _host_bytes(state) == 2 * 2 * 512 * 512 * 4 + 4
