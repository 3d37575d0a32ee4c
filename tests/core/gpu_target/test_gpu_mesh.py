"""``jzero.gpu_mesh``: compile-only GPU meshes from XLA's specs, compiled for on the CPU.

They need JAX's CUDA plugin (the ``gpu-compile`` extra, which ``scripts/test.sh`` installs);
without it this module is skipped. The errors that need no plugin are in
``test_gpu_target_errors.py``.
"""

from __future__ import annotations

import importlib.resources
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_models import NNXMLP, D, LinenMLP
from _paths import GPU_PLUGIN
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.core.gpu_target import gpu_names, is_compile_only

pytest.importorskip(
    GPU_PLUGIN,
    reason="needs JAX's CUDA plugin: pip install 'jzero[gpu-compile]' "
    "'jax-cuda12-plugin==V' 'jax-cuda12-pjrt==V' (V = jaxlib's version)",
)

GPUS = {  # name -> (device_kind, device_memory_size): the values of XLA's specs
    "a100": ("NVIDIA A100-SXM4-80GB", 85100068864),
    "b200": ("NVIDIA B200", 191514411008),
    "h100": ("NVIDIA H100 80GB HBM3", 84942979072),
    "h200": ("NVIDIA H200 141GB HBM3e", 151397597184),
    "v100": ("Tesla V100-SXM2-32GB", 34089730048),
    "v100-16gb": ("Tesla V100-SXM2-16GB", 16935682048),
}


def _spec(name: str) -> str:
    files = importlib.resources.files("jzero.core.gpu_target")
    return files.joinpath("specs", f"{name.replace('-', '_')}.txtpb").read_text()


def _rows(mesh, shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("data")))


def test_the_names_are_the_specs_shipped():
    assert gpu_names() == tuple(GPUS)


@pytest.mark.parametrize("name", GPUS)
def test_each_spec_parses_and_compiles_for_its_gpu(name):
    kind, memory = GPUS[name]
    text = _spec(name)
    assert re.search(r"^# Source: openxla/xla, xla/backends/gpu/target_config/specs/", text, re.M)
    assert re.search(r"^# at commit [0-9a-f]{40}\.$", text, re.M)
    assert f"device_memory_size: {memory}\n" in text
    assert f'device_description_str: "{kind}"' in text

    mesh = jzero.gpu_mesh(name.upper())
    assert dict(mesh.shape) == {"data": 8} and is_compile_only(mesh)
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    assert {d.platform for d in mesh.devices.flat} == {"gpu"}
    x = _rows(mesh, (64, 32))
    compiled = jax.jit(lambda x: jnp.tanh(x) * 2).trace(x).lower().compile()
    stats = compiled.memory_analysis()
    assert stats.argument_size_in_bytes == stats.output_size_in_bytes == 64 * 32 * 4 // 8


def test_the_cpu_devices_stay_beside_the_gpus():
    mesh = jzero.gpu_mesh("h200")
    assert jax.devices()[0].platform == "cpu" and jax.device_count() == 8
    assert not is_compile_only(jzero.data_mesh()) and not is_compile_only(jax.devices())
    assert is_compile_only(mesh.devices.flat[0]) and is_compile_only(list(mesh.devices.flat))


def test_64_gpus_over_8_hosts_compile_a_sharded_matmul():
    mesh = jzero.gpu_mesh("h100", devices=64, hosts=8)
    processes = [d.process_index for d in mesh.devices.flat]
    assert processes == [i // 8 for i in range(64)]  # host by host, 8 GPUs each
    assert [d.id for d in mesh.devices.flat] == list(range(64))
    x = _rows(mesh, (4096, 4096))
    compiled = jax.jit(lambda x: x @ x.T).trace(x).lower().compile()
    assert compiled.output_shardings.spec == P("data")
    assert compiled.memory_analysis().output_size_in_bytes == 4096 * 4096 * 4 // 64
    assert "all-gather" in compiled.as_text()


def test_two_axes_default_to_one_row_per_host():
    mesh = jzero.gpu_mesh("h200", devices=16, hosts=2, axis_names=("replica", "data"))
    assert dict(mesh.shape) == {"replica": 2, "data": 8}
    assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]
    mesh = jzero.gpu_mesh("h200", devices=16, hosts=2, axis_names=("data", "model"), shape=(4, 4))
    assert dict(mesh.shape) == {"data": 4, "model": 4}


def test_one_topology_per_cluster_whatever_the_spelling():
    a = jzero.gpu_mesh("h100").devices.flat[0]
    assert jzero.gpu_mesh("H100-SXM").devices.flat[0] is a
    assert jzero.gpu_mesh("h100:8").devices.flat[0] is a
    assert jzero.gpu_mesh("h100", devices=16, hosts=2).devices.flat[0] is not a
    h200s = jzero.gpu_mesh("h200:8x8")  # target=' and --target's spelling
    for same in (jzero.gpu_mesh("h200:64"), jzero.gpu_mesh("h200", devices=64, hosts=8),
                 jzero.gpu_mesh("h200", devices=64)):  # fmt: skip
        assert list(same.devices.flat) == list(h200s.devices.flat)
    assert [d.process_index for d in h200s.devices.flat] == [i // 8 for i in range(64)]


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def _init():
    return {"w1": jnp.zeros((256, 512)), "w2": jnp.zeros((512, 16))}


@pytest.fixture(scope="module")
def stage3():
    """A stage-3 Adam optimizer on 8 compile-only H100s, its abstract state and batch."""
    mesh = jzero.gpu_mesh("h100")
    opt = jzero.ZeroOptimizer(optax.adam(1e-3), mesh, stage=3)
    state = jax.eval_shape(*opt.init_program(init_fn=_init))
    batch = {"x": _rows(mesh, (64, 256)), "y": _rows(mesh, (64, 16))}
    return opt, state, batch


@pytest.mark.smoke  # a ZeRO step compiled for GPUs that are not there
def test_a_zero_optimizer_step_compiles_for_the_gpus(stage3):
    opt, state, batch = stage3
    w1 = state.params["w1"]
    assert w1.sharding.mesh == opt.mesh and w1.sharding.spec == P(None, "data")
    assert jax.tree.leaves(state.opt_state)[1].sharding.mesh == opt.mesh
    compiled = opt.train_step(_loss).lower(state, batch).compile()
    text = compiled.as_text()
    assert "all-gather" in text and "reduce-scatter" in text
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    shards = (nbytes((state.params, state.opt_state)) + nbytes(batch)) // 8  # one per GPU
    assert shards <= compiled.memory_analysis().argument_size_in_bytes < shards + 64  # scalars


def test_jzero_report_reads_a_step_compiled_for_the_gpus(stage3):
    """``jzero.report`` on an abstract state: the plan's model states against the paper's,
    and the collectives and peak of the step as XLA compiled it for the GPUs. (The report
    compiles the step itself: this small program's second compile, about a second; the
    example GPT's took 17 s in tests/core/gpu_target/test_compiled_for_gpus.py.)"""
    opt, state, batch = stage3
    report = jzero.report(opt.train_step(_loss), state, batch)
    assert report.devices == 8 and report.stage == 3
    assert report.model_state_ratio == pytest.approx(1.0, rel=0.01)
    assert report.comm_bytes["all-gather"] > 0 and report.comm_bytes["reduce-scatter"] > 0
    assert report.peak_bytes > 0


@pytest.mark.parametrize("gpus", ["h100:8", "h200:8x8"])
def test_running_on_the_gpus_is_refused_before_any_work(gpus, tmp_path):
    """Every public entry that would run on the mesh's devices (place, step, read or write
    arrays, measure) refuses compile-only GPUs before it starts, naming what takes them:
    jzero.autoconfigure plans for them (tests/autoconfig/test_target.py), a step compiles
    for them (above). No compile here."""
    mesh = jzero.gpu_mesh(gpus)
    opt = jzero.ZeroOptimizer(optax.adam(1e-3), mesh, stage=3)
    state = jax.eval_shape(*opt.init_program(init_fn=_init))
    batch = {"x": _rows(mesh, (64, 256)), "y": _rows(mesh, (64, 16))}
    sharded = jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=1)
    ckpt = jzero.Checkpointer(tmp_path / "ckpt")
    refused = {
        "ZeroOptimizer.init": lambda: opt.init(init_fn=_init),
        "TrainStep.__call__": lambda: opt.train_step(_loss)(state, batch),
        "ZeroOptimizer.full_params": lambda: opt.full_params(state),
        "ZeroOptimizer.full_state": lambda: opt.full_state(state),
        "jzero.shard_optimizer(...).init": lambda: sharded.init(_init()),
        "jzero.shard_params": lambda: jzero.shard_params(_init(), mesh),
        "jzero.Checkpointer.save": lambda: ckpt.save(0, state, force=True),
        "jzero.Checkpointer.restore": lambda: ckpt.restore(opt, jax.eval_shape(_init)),
        "jzero.checkpoint.export_safetensors": lambda: jzero.checkpoint.export_safetensors(
            opt, state, tmp_path / "model.safetensors"
        ),
        "jzero.distributed.global_batch": lambda: jzero.distributed.global_batch(
            mesh, {"x": np.zeros((64, 256), np.float32)}
        ),
    }
    for what, call in refused.items():
        with pytest.raises(RuntimeError, match=re.escape(f"{what} would run")) as e:
            call()
        assert f"compile-only GPUs from jzero.gpu_mesh ({mesh.devices.size} x " in str(e.value)
        assert "jzero.autoconfigure(..., mesh=mesh) plans for them" in str(e.value)
        assert "jax.jit(...).trace(...).lower().compile()" in str(e.value)
    with pytest.raises(ValueError, match=r"compile-only GPUs \(jzero.gpu_mesh\), where nothing"):
        jzero.autoconfig.calibrate(mesh)
    assert list(tmp_path.iterdir()) == []  # nothing written
    model, variables = NNXMLP(nnx.Rngs(0)), LinenMLP().init(jax.random.key(0), jnp.zeros((1, D)))
    flax_entries = [  # the Flax train states and nnx.Optimizer place through the calls above
        lambda: jzero.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param, mesh=mesh, stage=3),
        lambda: jzero.nnx.TrainState.create(model, tx=optax.adam(1e-3), mesh=mesh, stage=1),
        lambda: jzero.linen.TrainState.create(
            apply_fn=LinenMLP().apply, variables=variables, tx=optax.adam(1e-3), mesh=mesh, stage=2
        ),
    ]
    for call in flax_entries:
        with pytest.raises(RuntimeError, match="would run on the mesh's devices, but these are"):
            call()


def test_offload_is_refused_on_the_gpus():
    mesh = jzero.gpu_mesh("h100")
    for offload in (jzero.Offload(optimizer="stream"), jzero.Offload(params=True)):
        with pytest.raises(ValueError, match="XLA drops memory kinds on them"):
            jzero.ZeroOptimizer(optax.adam(1e-3), mesh, stage=3, offload=offload)
    jzero.ZeroOptimizer(optax.adam(1e-3), mesh, stage=3, offload=jzero.Offload())  # none


def test_shard_params_gives_shapes_their_stage_3_shardings_for_the_gpus(stage3):
    """Shapes in, shapes out with the shardings stage 3 rests them in (those of jzero's own
    state where no padding is needed), nothing placed: a user's own jit step with
    shard_optimizer then lowers and compiles for the GPUs from them, gathering at stage 3."""
    opt, state, batch = stage3
    placed = jzero.shard_params(jax.eval_shape(_init), opt.mesh)
    for name in ("w1", "w2"):
        assert isinstance(placed[name], jax.ShapeDtypeStruct)
        assert placed[name].sharding == state.params[name].sharding, name
    stage2 = jzero.shard_params(jax.eval_shape(_init), opt.mesh, stage=2)
    assert stage2["w1"].sharding == NamedSharding(opt.mesh, P())
    tx = jzero.shard_optimizer(optax.adam(1e-3), opt.mesh, stage=3)
    opt_state = jax.eval_shape(tx.init, placed)

    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(_loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step).trace(placed, opt_state, batch).lower().compile()
    assert "all-gather" in compiled.as_text()
    with pytest.raises(ValueError, match="mixed with arrays; pass only shapes"):
        jzero.shard_params({"w1": placed["w1"], "w2": jnp.zeros((512, 16))}, opt.mesh)
