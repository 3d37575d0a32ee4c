"""What XLA's GPU compiler makes of jzero's step and of the user's own step with
``jzero.shard_optimizer``, compiled for 8 H200s and for 64 over 8 hosts (``jzero.gpu_mesh``).

The model is the example GPT (``examples/gpt.py``: 4 scanned, rematerialised blocks,
d_model 512, bf16 compute, fp32 parameters and AdamW), 64 sequences of 128 tokens. Every
figure is read from the compiled program: its collectives (kind, elements, trip count),
its schedule (what runs between an asynchronous collective's start and done) and its
buffer assignment (``memory_analysis()``). A compile is a fact about the GPU program, so
these are exact assertions; times stay with a lent GPU.

The compiles (11 in CI's tier, 15-25 s each on 2 cores) run in two xdist groups, one per
mesh (8 and 64 GPUs): each program compiles on one worker only, and once: steps that lower
to the same text for the same GPUs and options share it (``scripts/gpu_compile.py``).
"""

from __future__ import annotations

import math

import pytest
from _paths import GPU_PLUGIN, load_script

# Every case on 8 GPUs in CI (tests/_ci_tier.py): P23 names each stage, step and mesh.
pytestmark = pytest.mark.every_case

pytest.importorskip(
    GPU_PLUGIN,
    reason="needs JAX's CUDA plugin: pip install 'jzero[gpu-compile]' "
    "'jax-cuda12-plugin==V' 'jax-cuda12-pjrt==V' (V = jaxlib's version)",
)


def on(devices: int):
    """The xdist group of the tests that read programs compiled for ``devices`` GPUs."""
    return pytest.mark.xdist_group(f"gpu_compile_{devices}")


# On 64 GPUs CI compiles two of the seven programs, jzero's stage 3 (3Ψ, the per-layer
# gathers) and the user's stage 1 (the compiler's reduce-scatter); the other cases on 64
# are extended (tests/_ci_tier.py: about 35 s a compile of CI's 2 cores), run by -m ''.
IN_CI_ON_64 = {("jzero", 3), ("user", 1), (3,)}  # (kind, stage), or jzero's (stage,)


def grouped(cases):
    """``cases`` as ``pytest.param`` s, each in the group of its mesh (its last value)."""
    return [pytest.param(*case, marks=_marks(tuple(case))) for case in cases]


def _marks(case: tuple) -> list:
    extended = case[-1] == 64 and case[:-1] not in IN_CI_ON_64
    return [on(case[-1])] + ([pytest.mark.extended] if extended else [])


programs = load_script("gpu_compile")  # the programs, and their figures for the JSON
L, PSI, STACK = programs.L, programs.PSI, programs.STACK
jzero_step, user_step, plain_step = programs.jzero_step, programs.user_step, programs.plain_step

STEPS = {"jzero": jzero_step, "user": user_step}
ZERO = [(kind, stage) for kind in STEPS for stage in (1, 2, 3)]


@pytest.mark.parametrize(
    ("kind", "stage", "devices"), grouped((*z, n) for z in ZERO for n in (8, 64))
)
def test_no_gradient_is_all_reduced_at_stages_1_to_3(kind, stage, devices):
    """Gradients are reduce-scattered. jzero's step all-reduces scalars alone (the loss, the
    gradient norm); in the user's step the compiler places the collectives, and on 64 GPUs
    it all-reduces one layer's qkv bias (1,536 elements, 0.05 % of the parameters) inside
    the backward loop: at most 0.1 % of the parameters may be all-reduced there."""
    program = STEPS[kind](stage, devices)
    reduced = [c for c in program.found if c.kind == "all-reduce"]
    if kind == "jzero":
        assert all(math.prod(c.shape) <= 2 for c in reduced), reduced
    elements = sum(math.prod(c.shape) * c.trip_count for c in reduced)
    assert elements <= 0.001 * PSI, [(c.dtype, c.shape, c.trip_count) for c in reduced]
    assert program.elements("reduce-scatter") > 0


# one stage-3 user step (on 8 GPUs): its compile is the slowest
VOLUMES = [
    (k, s, n) for n in (8, 64) for k, s in [("jzero", 0), *ZERO] if (k, s, n) != ("user", 3, 64)
]


@pytest.mark.parametrize(("kind", "stage", "devices"), grouped(VOLUMES))
def test_elements_sent_are_the_papers_2_2_and_3_psi(kind, stage, devices):
    """The ZeRO paper's volumes, 2Ψ (stages 0-2) and 3Ψ (stage 3) per device in the ring
    model, counted in elements: XLA may move a bf16 cast of a parameter or gradient."""
    program = STEPS[kind](stage, devices)
    theory = (3 if stage == 3 else 2) * PSI * (devices - 1) / devices
    assert program.elements() == pytest.approx(theory, rel=0.02), program.elements() / theory


@on(8)
def test_stage_3_gathers_each_layer_inside_the_forward_and_backward_loops():
    program = jzero_step(3)
    gathered = program.in_loops("all-gather")
    loops = {c.computation for c in gathered}
    assert len(loops) >= 2, loops  # the forward loop's body and the backward loop's
    stack = sum(x.size for x in STACK)
    in_loop = sum(math.prod(c.shape) * c.trip_count for c in gathered)
    # each layer gathered in forward and again in backward (its first iteration peeled)
    assert in_loop >= 2 * stack * (L - 1) / L, (in_loop, stack)


@on(8)
@pytest.mark.parametrize("kind", STEPS)
def test_stage_2_reduce_scatters_each_layer_inside_the_backward_loop(kind):
    program = STEPS[kind](2)
    in_loop = sum(math.prod(c.shape) * 8 * c.trip_count for c in program.in_loops("reduce-scatter"))
    assert in_loop >= sum(x.size for x in STACK) * (L - 1) / L


@on(8)
def test_stage_2_holds_no_whole_stacked_gradient():
    """P23's bound: stage 2's temporaries at most stage 1's (which holds the whole local
    gradient until backward ends) less 0.8 x the stack's fp32 gradient."""
    stack = 4 * sum(x.size for x in STACK)
    assert jzero_step(2).temp <= jzero_step(1).temp - 0.8 * stack, (jzero_step(2).temp, stack)


@pytest.mark.parametrize(("stage", "devices"), grouped([(2, 8), (3, 8), (2, 64), (3, 64)]))
def test_no_loop_carries_a_layers_full_gradients_into_the_next_step(stage, devices):
    """XLA:GPU pipelines a loop's reduce-scatters into the next step by default, carrying
    each layer's full weight gradients along; jzero's step is compiled with the pipeliner
    off (``jzero.core.compile_options``), so backward keeps only their shards."""
    program = jzero_step(stage, devices)
    assert programs.layer_arrays_carried(program) == 0, program.carried


@pytest.mark.parametrize(("stage", "devices"), grouped((s, n) for s in range(4) for n in (8, 64)))
def test_the_layers_inputs_are_one_stack_saved_by_forward_and_read_by_backward(stage, devices):
    """At stage 3 the step's outer checkpoint once made JAX save each layer's output and
    stage a third loop rebuilding the inputs from it: two stacks alive at once, 2.3 GB of
    Table 2's stage-3 model on V100s (``jzero.core.gather.autogather._carry_named``)."""
    program = jzero_step(stage, devices)
    assert programs.activation_stacks(program, devices) == 2, program.carried


@on(8)
def test_pipeline_scatter_carries_them_for_more_memory():
    """``Communication(pipeline_scatter=True)`` leaves XLA's pipeliner on: the backward
    loop carries one layer's four fp32 weight gradients, and the step needs more memory.
    (The one program compiled twice here: the same text as the default step's, compiled
    with XLA's pipeliner left on.)"""
    pipelined, default = jzero_step(3, pipeline_scatter=True), jzero_step(3)
    carried = sorted(s for d, s in pipelined.carried if s in programs.LAYER_MATRICES)
    assert carried == sorted(programs.LAYER_MATRICES), pipelined.carried
    assert {d for d, s in pipelined.carried if s in programs.LAYER_MATRICES} == {"f32"}
    assert pipelined.temp > default.temp, (pipelined.temp, default.temp)


@on(8)
def test_prefetch_puts_compute_under_every_all_gather_in_the_loops():
    """``Communication(prefetch=True)``: each in-loop all-gather of forward and backward has
    a layer's compute scheduled between its start and its done."""
    looped = [o for o in jzero_step(3, prefetch=True).overlaps
              if o.kind == "all-gather" and (o.trip_count or 1) > 1]  # fmt: skip
    assert looped and all(o.asynchronous and o.overlaps for o in looped), looped


@on(8)
def test_stage_0_is_within_5_percent_of_plain_data_parallel():
    assert jzero_step(0).temp <= 1.05 * plain_step().temp, (jzero_step(0).temp, plain_step().temp)


@on(8)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_1_to_3_need_no_more_than_stage_0(stage):
    assert jzero_step(stage).temp <= jzero_step(0).temp


@on(8)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_are_the_papers_in_the_buffer_assignment(stage):
    """The step's inputs, per device: parameters (fp32, 4 bytes) whole at stages 0-2 and
    1/N at stage 3, AdamW's two moments (K = 8 bytes) whole at stage 0 and 1/N from stage
    1, within 1 % (the rest: the batch's shard and Adam's step counter)."""
    n = 8
    params = 4 * PSI / (n if stage == 3 else 1)
    moments = 8 * PSI / (n if stage >= 1 else 1)
    assert jzero_step(stage).argument == pytest.approx(params + moments, rel=0.01)
