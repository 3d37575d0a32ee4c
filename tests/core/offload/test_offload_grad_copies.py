"""The host step's gradients go to host memory in backward, as each is reduced (ZeRO-Offload's
gradient copy during backward), on 8 CPU devices.

XLA:CPU lowers a move between memories to nothing, so what a GPU is given is read from the
step lowered for ``cuda`` (``TrainStep.lower(..., platforms=("cuda",))``): every
reduce-scatter of an offloaded leaf's gradient is followed at once by its move to pinned
host memory, inside the backward loop of a scanned stack. What XLA:CPU schedules is read
from the compiled step: each leaf's host update starts before backward has reduced the
last gradient. The numbers are those of the step without offload, bitwise.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.core.comm import reducer
from jzero.core.comm.reducer import Reducer, makes_host_copies

L, D = 4, 64
ON_HOST = jzero.Offload(optimizer="host")


def _stack() -> tuple[dict, callable]:
    """A scanned stack of L layers and a bias outside the scan."""
    params = {"w": jax.random.normal(jax.random.key(0), (L, D, D)) / 8, "b": jnp.zeros((D,))}

    def loss(p, batch):
        body = lambda x, w: (jnp.tanh(x @ w + p["b"]), None)
        return jnp.mean(jax.lax.scan(body, batch, p["w"])[0] ** 2)

    return params, loss


def _layers() -> tuple[dict, callable]:
    """The same L layers, unrolled: a leaf per layer."""
    keys = jax.random.split(jax.random.key(0), L)
    params = {f"w{i}": jax.random.normal(k, (D, D)) / 8 for i, k in enumerate(keys)}

    def loss(p, batch):
        x = batch
        for i in range(L):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x**2)

    return params, loss


MODELS = {"scanned": _stack, "unrolled": _layers}
BATCH = jax.random.normal(jax.random.key(1), (16, D))


def _opt(stage: int, offload=ON_HOST, **kwargs) -> jzero.ZeroOptimizer:
    mesh = jzero.data_mesh()
    return jzero.ZeroOptimizer(
        optax.adam(1e-2), mesh, stage=stage, min_shard_size=1, offload=offload, **kwargs
    )


def _functions(text: str) -> dict[str, str]:
    """Each function of a lowered module, by name: its body's text."""
    parts = re.split(r"^  func\.func \w+ @([\w.]+)", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _runs(functions: dict[str, str]) -> dict[str, int]:
    """How many times each function runs per run of ``main``: each of its call sites, times
    its caller's runs (stage 3 traces a layer's use once and calls it from every layer)."""
    runs = {"main": 1}

    def count(name: str) -> int:
        if name not in runs:
            sites = {
                g: len(re.findall(rf"call @{re.escape(name)}\(", b)) for g, b in functions.items()
            }
            runs[name] = sum(count(g) * n for g, n in sites.items() if n and g != name)
        return runs[name]

    return {name: count(name) for name in functions}


def _reduce_scatters(text: str) -> list[tuple[str, bool]]:
    """Each reduce-scatter a run of a lowered module (``as_text(debug_info=True)``) does,
    once per run of the function holding it: its name stack (JAX's, e.g.
    ``transpose(...)/while/body/...``) and whether its result is moved to pinned host memory
    by the very next use of it, in that function."""
    locs = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', text, re.M))
    functions, found = _functions(text), []
    for name, runs in _runs(functions).items():
        body = functions[name]
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if (m := re.search(r'(%[\w#]+) = "stablehlo.reduce_scatter"', line)) is None:
                continue
            close = next(x for x in lines[i + 1 :] if x.strip().startswith("}) :"))
            loc = re.search(r"loc\((#loc\d+)\)\s*$", close)
            placed = (
                rf"annotate_device_placement\({m[1]}\).*_xla_buffer_placement = \"pinned_host\""
            )
            copied = re.search(placed, body) is not None
            found += [(locs.get(loc[1], "") if loc else "", copied)] * runs
    return found


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("stage", [2, 3])
def test_backward_moves_each_gradient_to_host_as_it_reduces_it(stage, model):
    params, loss = MODELS[model]()
    opt = _opt(stage)
    state = opt.init(params)
    lowered = opt.train_step(loss, donate=False).lower(state, BATCH, platforms=("cuda",))
    found = _reduce_scatters(lowered.as_text(debug_info=True))
    in_backward = [copied for name, copied in found if "transpose(" in name]
    assert len(in_backward) == len(params) and all(in_backward), found
    # a scanned stack's gradient is reduced (and moved) per layer, in the backward loop
    in_loop = [copied for name, copied in found if "while/body" in name]
    assert in_loop == ([True] if model == "scanned" else []), found


def test_the_host_update_starts_before_backward_ends_on_xla_cpu():
    """XLA:CPU inlines each leaf's host computation and schedules the last layer's update
    before the first layer's gradient is reduce-scattered."""
    params, loss = _layers()
    opt = _opt(3)
    state = opt.init(params)
    text = opt.train_step(loss, donate=False).lower(state, BATCH).compile().as_text()
    entry = text[text.index("\nENTRY") :].splitlines()
    update = [i for i, x in enumerate(entry) if "compute_on" in x and " fusion(" in x]
    scatters = [i for i, x in enumerate(entry) if " reduce-scatter(" in x]
    assert len(scatters) == L and update
    assert min(update) < max(scatters)


@pytest.mark.parametrize(
    ("stage", "offload", "kwargs", "copies"),
    [
        (2, ON_HOST, {}, True),
        (3, ON_HOST, {}, True),
        (1, ON_HOST, {}, False),  # stage 1 reduces after backward
        (3, jzero.Offload(optimizer="stream"), {}, False),  # the update runs on the device
        (3, ON_HOST, {"step": jzero.StepOptions(grad_accum=2)}, False),  # the host reads
        # the micro-batches' sum
        (3, ON_HOST, {"comm": jzero.Communication(prefetch=True)}, False),  # their own VJP
        (3, ON_HOST, {"comm": jzero.Communication(hpz=2)}, False),
    ],
)
def test_which_configurations_copy_in_backward(stage, offload, kwargs, copies):
    step = kwargs.pop("step", None)
    config = _opt(stage, offload, **kwargs).config
    config = config if step is None else dataclasses.replace(config, step=step)
    assert makes_host_copies(config) is copies


CASES = {
    "host": ON_HOST,
    "delayed": jzero.Offload(optimizer="host", delay=1, exact_steps=1),
    "ratio": jzero.Offload(optimizer="host", ratio=0.5),  # unrolled: half the layers
}


@pytest.mark.parametrize(
    ("model", "case", "comm"),
    [
        ("scanned", "host", None),
        ("scanned", "delayed", None),
        ("unrolled", "host", jzero.Communication(bucket=True)),
        ("unrolled", "delayed", None),
        ("unrolled", "ratio", None),
    ],
)
@pytest.mark.parametrize("stage", [2, 3])
def test_the_copies_change_no_number(monkeypatch, stage, model, case, comm):
    """Each of three steps, taken from the same state with the copies made in backward and
    with the host step copying each gradient after backward instead (as before the
    copies): bitwise the same next state (per step: no rounding carried over)."""
    params, loss = MODELS[model]()
    opt = _opt(stage, CASES[case], comm=comm)
    state, with_copies = opt.init(params), opt.train_step(loss, donate=False)
    assert any(Reducer.of(opt.config).host_copied(state.plan))
    with monkeypatch.context() as patch:
        patch.setattr(reducer, "makes_host_copies", lambda config: False)
        after_backward = opt.train_step(loss, donate=False)  # its Reducer: no copies
        assert not any(Reducer.of(opt.config).host_copied(state.plan))
    for _ in range(3):
        got, _ = with_copies(state, BATCH)
        want, _ = after_backward(state, BATCH)
        for a, b in zip(
            jax.tree.leaves(opt.full_state(got)), jax.tree.leaves(opt.full_state(want))
        ):
            np.testing.assert_array_equal(a, b)
        state = got
