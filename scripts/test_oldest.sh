#!/usr/bin/env bash
# Runs a stated subset of the tests on the oldest supported versions (ci/oldest-pins.txt:
# the lent GPU image's exact set, jax 0.11.2 on Python 3.12) in a fresh venv of its own.
# The subset is what reads or leans on JAX's moving parts, one case each where the newest
# run covers the grid: the checks that name each JAX internal jzero relies on and the
# moved-internal fallbacks, the HLO collectives of every stage, ZeRO in the user's own
# jit step (shard_map, Explicit meshes, the compiler's HLO), Optax parity at stages 2-3,
# the host optimizer step (compute_on's form changed in jax 0.11.1) with its checkpoint
# and its gradient copies in backward (read from the step lowered for cuda), the host
# step compiled by XLA's GPU compiler (it refused two shapes of it on the H200's 0.11.2),
# the compiled peak per memory space (it reads XLA's HLO text), the XLA compile option
# jzero's GPU step passes (XLA renamed it once), stage 3's scans saving each layer's
# input once (JAX's checkpoint-of-scan rule decides it), its whole-loss checkpoint only
# where a gathered parameter is held (read from JAX's mark on saved values), Orbax
# checkpoints that reshard, Flax Linen and NNX at stage 3, jzero.gpu_mesh and three of
# its compiles for 8 absent GPUs (the CUDA plugin 0.11.2: the user step's stage-1
# reduce-scatter, stage 2's per-layer reduce-scatter over a scan, stage 3's per-layer
# gathers with the pipeliner off; the newest run compiles every one, on 8 and 64), what
# the peers' tests pass a drop-in (L-BFGS's value_fn, typed keys, complex parameters),
# Muon on whole matrices (the mixed-axes pass and the stacks read jaxprs: one oracle case
# per path, and the bytes of the user's step, whose layout the compiler propagates),
# and the GPU check's fast tests (test_gpu_check). --dist loadgroup: the GPU programs
# the group shares are compiled once, on one worker.
# scripts/test.sh runs everything on the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv-oldest =3.12  # the GPU image's Python minor
.venv-oldest/bin/python -m pip install -q -e '.[dev]' -c ci/oldest-pins.txt
# jzero.gpu_mesh's tests: the CUDA plugin (compile-only) at the oldest jaxlib, 0.11.2
.venv-oldest/bin/python -m pip install -q -e '.[dev,gpu-compile]' -c ci/oldest-pins.txt \
    'jax-cuda12-plugin==0.11.2' 'jax-cuda12-pjrt==0.11.2'
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" \
    --dist loadgroup \
    tests/internal/test_versions.py tests/internal/test_jax_internals.py \
    tests/core/test_moved_internals.py tests/core/test_compile_options.py \
    tests/accounting/test_hlo_stages.py \
    tests/optimizers/user_step/test_user_step_inputs.py tests/optimizers/user_step/test_user_step_is_zero.py \
    "tests/core/test_parity.py::test_matches_single_device_optax[2-adafactor]" \
    "tests/core/test_parity.py::test_matches_single_device_optax[3-adamw]" \
    "tests/core/offload/test_offload_host_step.py::test_host_step_places_the_state_on_host_and_matches_the_device_run[3-clip_adamw]" \
    "tests/core/offload/test_offload_host_step.py::test_checkpoint_round_trips_a_host_step_state_bitwise" \
    "tests/core/offload/test_offload_host_step.py::test_each_leaf_is_updated_in_its_own_host_computation" \
    tests/core/offload/test_offload_grad_copies.py tests/core/offload/test_host_step_gpu_compile.py \
    "tests/accounting/test_memory_spaces.py::test_offload_takes_what_rests_on_the_host_off_the_device_peak[3-host-True]" \
    "tests/accounting/test_memory_spaces.py::test_without_offload_the_device_peak_is_within_xlas_packing[3-True]" \
    "tests/checkpoint/test_checkpoint.py::test_round_trip_reshards_across_stages_and_device_counts[saved3-restored3]" \
    "tests/checkpoint/test_checkpoint.py::test_resume_equals_uninterrupted_bitwise[precision1]" \
    "tests/adapters/test_flax.py::test_linen_matches_single_device[3]" \
    "tests/adapters/test_flax.py::test_nnx_matches_single_device[3]" \
    tests/core/gpu_target/test_gpu_mesh.py tests/core/gpu_target/test_gpu_target_errors.py \
    "tests/core/gpu_target/test_compiled_for_gpus.py::test_no_gradient_is_all_reduced_at_stages_1_to_3[user-1-8]" \
    "tests/core/gpu_target/test_compiled_for_gpus.py::test_stage_2_reduce_scatters_each_layer_inside_the_backward_loop[jzero]" \
    "tests/core/gpu_target/test_compiled_for_gpus.py::test_no_loop_carries_a_layers_full_gradients_into_the_next_step[3-8]" \
    tests/core/gpu_target/test_compiled_for_gpus.py::test_stage_3_gathers_each_layer_inside_the_forward_and_backward_loops \
    "tests/optimizers/user_step/test_drop_in_inputs.py::test_lbfgs_line_search_takes_the_loss_function_as_an_extra_argument[jit-3]" \
    "tests/optimizers/user_step/test_drop_in_inputs.py::test_a_typed_key_in_the_state_of_jzeros_own_step[3]" \
    "tests/optimizers/user_step/test_drop_in_inputs.py::test_complex_parameters_in_the_users_step[2]" \
    "tests/optimizers/user_step/test_drop_in_inputs.py::test_complex_parameters_in_jzeros_own_step[3-options3]" \
    "tests/optimizers/user_step/test_drop_in_inputs.py::test_complex_parameters_in_jzeros_own_step[2-options4]" \
    tests/checkpoint/test_typed_key_state.py \
    tests/core/gather/test_autogather.py::test_a_scan_runs_as_two_loops_saving_each_layers_input_once \
    "tests/core/gather/test_unrolled_stage3.py::test_only_a_held_parameter_puts_the_loss_under_a_checkpoint" \
    "tests/core/gather/test_unrolled_stage3.py::test_a_use_repeated_in_every_layer_is_traced_once" \
    "tests/core/gather/test_unrolled_stage3.py::test_matches_single_device_optax[loop]" \
    tests/internal/test_mixed_axes.py \
    "tests/core/test_matrix_optimizers.py::test_each_step_is_single_device_optax[muon-1]" \
    "tests/core/test_matrix_optimizers.py::test_each_step_is_single_device_optax[muon_scanned-3]" \
    "tests/core/test_matrix_optimizer_costs.py::test_muon_moves_zero_bytes_and_its_share_of_the_flops[3-unrolled-user]" \
    "$@"
# test_gpu_check's fast tests. Its dry run (every part at tiny sizes, 13 minutes of 2
# cores) is `extended`: scripts/test.sh -m '' runs it, on the newest versions.
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider tests/project/test_gpu_check.py "$@"
