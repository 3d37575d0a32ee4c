"""``jzero.autoconfigure(..., target=...)``, or ``mesh=`` a ``jzero.gpu_mesh``: a plan for
GPUs that are not here, compiled by XLA's GPU compiler (the ``gpu-compile`` extra, which
``scripts/test.sh`` installs; the parsing and its errors need none). The tiny example GPT
keeps each compile to seconds. The spelling of a cluster is ``jzero.gpu_mesh``'s
(``tests/core/gpu_target/test_gpu_target_errors.py``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from _paths import GPU_PLUGIN

import jzero
from jzero.autoconfig.search import COMPILE_ONLY_MESH_NOTE
from jzero.autoconfig.target import parse_target, target_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

PLUGIN = importlib.util.find_spec(GPU_PLUGIN) is not None
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="needs jzero[gpu-compile]")
CFG = gpt.GPTConfig(vocab_size=512, seq_len=32, d_model=128, n_heads=2, n_layers=2)
BATCH = {"tokens": jax.ShapeDtypeStruct((16, CFG.seq_len + 1), jnp.int32)}
INIT = functools.partial(gpt.init_params, CFG, jax.random.key(0))


@pytest.mark.parametrize(
    "spelled, gpu, hosts, devices",
    [("h100:64", "h100", 8, 64), ("h200:8x8", "h200", 8, 64), ("a100", "a100", 1, 8),
     ("V100-32GB:4", "v100", 1, 4), ("b200:2x4", "b200", 2, 8)],
)  # fmt: skip
def test_a_target_names_gpus_and_hosts(spelled, gpu, hosts, devices):
    target = parse_target(spelled)
    assert (target.gpu, target.hosts, target.devices) == (gpu, hosts, devices)


@pytest.mark.parametrize(
    "spelled, message",
    [("h100:12", r"12 GPUs do not split into hosts of 8; say the hosts, e\.g\. 'h100:2x6'"),
     ("x100:8", r"unknown GPU 'x100' in 'x100:8': jzero.gpu_mesh knows a100, b200, h100, h200"),
     ("h100:0", "has no GPUs"), ("h100 64", "are not spelled as jzero knows: write 'h100:8'")],
)  # fmt: skip
def test_a_bad_target_says_how_to_spell_it(spelled, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_target(spelled)
    assert "'h200:8x8'" in str(e.value) or "'h100:2x6'" in str(e.value)  # the forms
    with pytest.raises(ValueError, match=message):  # before anything is compiled
        jzero.autoconfigure(gpt.make_loss_fn(CFG), init_fn=INIT, batch=BATCH,
                            tx=optax.adamw(1e-3), target=spelled)  # fmt: skip


def test_the_budget_is_the_share_jax_takes_of_the_gpus_memory(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert target_budget(parse_target("h100:8")) == 0.75 * 84942979072
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert target_budget(parse_target("h100:8")) == 0.9 * 84942979072


def test_mesh_and_target_are_one_or_the_other():
    plan = functools.partial(
        jzero.autoconfigure, gpt.make_loss_fn(CFG), init_fn=INIT, batch=BATCH, tx=optax.adamw(1e-3)
    )
    with pytest.raises(ValueError, match="got mesh= and target="):
        plan(mesh=jzero.data_mesh(), target="h100:8")
    with pytest.raises(TypeError, match="needs mesh= or target="):
        plan()


@needs_plugin
@pytest.mark.parametrize("gpus", ["h100:8", "h200:8x8"])
def test_a_compile_only_mesh_is_refused_what_a_target_is_refused(gpus):
    """mesh= of compile-only GPUs plans as target= does, so it takes what target= takes:
    with target= too, or with offload, it is refused before anything is compiled."""
    plan = functools.partial(
        jzero.autoconfigure, gpt.make_loss_fn(CFG), init_fn=INIT, batch=BATCH, tx=optax.adamw(1e-3)
    )
    mesh = jzero.gpu_mesh(gpus)
    with pytest.raises(ValueError, match="got mesh= and target="):
        plan(mesh=mesh, target=gpus)
    with pytest.raises(ValueError, match="plan offload; offload not considered"):
        plan(mesh=mesh, host_budget=1e9)


def _plan(**kwargs):
    return jzero.autoconfigure(gpt.make_loss_fn(CFG), init_fn=INIT, batch=BATCH,
                               tx=optax.adamw(1e-3), stages=(2,), **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def h100_plan():
    """Stage 2 planned for 8 H100s: each device's two rows fit at once."""
    return _plan(target="h100:8")


def _h100s(spelled: str):
    """8 H100s as a target string, or as the ``jzero.gpu_mesh`` of them."""
    return jzero.gpu_mesh("h100", devices=8) if spelled == "mesh" else spelled


@needs_plugin
@pytest.mark.xdist_group("h100_plans")
def test_a_plan_for_gpus_that_are_not_here(h100_plan):
    """Compiled for 8 H100s: the chosen configuration's compiled peak is within the H100's
    budget, and the offload note is in the result. (A ``jzero.gpu_mesh`` target: the
    budget from its GPUs in the refusal below, a search on it in the micro-batch test.)"""
    choice = h100_plan
    assert choice.config is not None and choice.config.stage == 2
    assert choice.device_budget == target_budget(parse_target("h100:8"))
    assert 0 < choice.chosen.device_bytes <= choice.device_budget
    assert choice.chosen.collective_bytes > 0 and choice.chosen.seconds > 0
    assert any("offload not considered" in note for note in choice.notes)
    assert "offload not considered" in choice.summary()
    report = choice.report()  # the search's compile, read again: no GPU compile here
    assert report.stage == 2 and report.devices == 8
    assert report.peak_bytes_by_space["device"] == choice.chosen.device_bytes
    assert report.comm_bytes["total"] == choice.chosen.collective_bytes


@needs_plugin
def test_plans_with_offload_are_refused_for_a_target():
    with pytest.raises(ValueError, match="plan offload; offload not considered"):
        jzero.autoconfigure(gpt.make_loss_fn(CFG), init_fn=INIT, batch=BATCH,
                            tx=optax.adamw(1e-3), target="h100:8", host_budget=1e9)  # fmt: skip


@needs_plugin
@pytest.mark.parametrize("where", ["target", "target_mesh", "mesh"])
def test_a_model_too_large_for_the_target_says_how_many_gpus_would_hold_it(where, capsys):
    """Model states alone over budget at every stage: refused before any compile, with
    the estimator's count of GPUs (whole hosts of 8) and the H100's budget, also when the
    target is a ``jzero.gpu_mesh``, passed as target= or as mesh=."""
    huge = {"w": jax.ShapeDtypeStruct((2**20, 2**17), jnp.float32)}  # 137 B parameters
    # 274.88 GB of states per GPU at stage 3 over 63.71 GB: 35 GPUs, whole hosts of 8
    message = r"\(274\.88 GB per GPU at best.*63\.71 GB on every one of the 8 GPUs at every "
    gpus = _h100s("mesh" if where != "target" else "h100:8")
    with pytest.raises(ValueError, match=message + "stage; about 40 such GPUs would hold"):
        jzero.autoconfigure(lambda p, b: jnp.sum(p["w"]), huge, batch=BATCH,
                            tx=optax.adamw(1e-3), **{where.partition("_")[0]: gpus})  # fmt: skip
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (
        "jzero.autoconfigure: planning for 8 x NVIDIA H100 80GB HBM3 (compile-only, 1 host), "
        "a device budget of 63.71 GB each"
    )
    assert said[-1].startswith(
        "jzero.autoconfigure: skipped without compiling, their model states over the 63.71 GB "
        "budget by the estimate: zero0 ("
    )
    assert said[-1].endswith("zero3 (274.88 GB), zero3 recompute (274.88 GB)")
    assert (COMPILE_ONLY_MESH_NOTE in "".join(said)) == (where == "mesh")


@needs_plugin
def test_64_h200s_passed_as_mesh_are_planned_for_as_a_target(capsys):
    """mesh=jzero.gpu_mesh("h200:8x8") is the target "h200:8x8": its budget, 8 hosts, and
    the line that says so; refused here (the model is too large) before any compile."""
    huge = {"w": jax.ShapeDtypeStruct((2**22, 2**17), jnp.float32)}  # 550 B parameters
    batch = {"tokens": jax.ShapeDtypeStruct((64, CFG.seq_len + 1), jnp.int32)}
    with pytest.raises(ValueError, match=r"113\.55 GB on every one of the 64 GPUs"):
        jzero.autoconfigure(lambda p, b: jnp.sum(p["w"]), huge, batch=batch,
                            tx=optax.adamw(1e-3), mesh=jzero.gpu_mesh("h200:8x8"))  # fmt: skip
    said = capsys.readouterr().err.splitlines()
    assert said[:2] == [
        "jzero.autoconfigure: planning for 64 x NVIDIA H200 141GB HBM3e (compile-only, 8 "
        "hosts), a device budget of 113.55 GB each",
        f"jzero.autoconfigure: {COMPILE_ONLY_MESH_NOTE}",
    ]


@needs_plugin
@pytest.mark.xdist_group("h100_plans")
def test_the_answer_shows_the_next_larger_micro_batch_does_not_fit(h100_plan):
    """With a budget just under the one-micro-batch step's compiled peak, the chosen
    configuration takes two micro-batches, and ``choice.larger`` is that same
    configuration at one, as compiled by the same GPU compiler: over the budget. (Searched
    on a ``jzero.gpu_mesh`` of the H100s passed as ``mesh=``, the way every other jzero
    function takes a mesh: planned for as the target it is, and the notes say so.) The
    one program compiled twice in this file: this search compiles its accum=1 candidate
    again, as every search compiles its own candidates."""
    whole = h100_plan
    assert whole.chosen.config.step.grad_accum == 1 and whole.larger is None
    one = next(r for r in whole.rows if r.name == "zero2 accum=1")
    assert one.compile_seconds > 0
    cut = _plan(mesh=_h100s("mesh"), device_budget=one.device_bytes - 1)
    assert cut.notes == (COMPILE_ONLY_MESH_NOTE, whole.notes[0])
    row, larger = cut.chosen, cut.larger
    assert row.config.step.grad_accum == 2 and row.micro_batch == 1
    assert larger.config == dataclasses.replace(
        row.config, step=dataclasses.replace(row.config.step, grad_accum=1)
    )
    assert larger.micro_batch == 2 * row.micro_batch and not larger.fits
    assert row.device_bytes <= cut.device_budget < larger.device_bytes
    assert f"next-larger micro-batch ({larger.micro_batch} rows per device)" in cut.summary()
