"""Test setup: 8 forced CPU devices, before any device is touched.

Strict dtype promotion (as equinox's tests use) is not switched on: Optax itself raises
under it (e.g. Adam's bias correction computes ``float ** int32``), and the oracle here is
unmodified Optax.
"""

import os
import shutil
import tempfile

# The CPU alone, in this process and in the processes tests start: with JAX's CUDA plugin
# installed (the gpu-compile extra, for jzero.gpu_mesh) and no GPU, JAX would otherwise try
# the plugin first. It still describes GPUs to compile for.
os.environ["JAX_PLATFORMS"] = "cpu"

# XLA's code generation cheaper, for this process and the processes tests start: LLVM at -O1
# without its expensive passes (XLA:CPU's kernels, the GPU compiles' PTX), ptxas without
# optimisation, and XLA:CPU's LLVM module generated in one piece (by default it is cloned
# into up to 32 parts for threads to generate in parallel, which two workers on two cores
# cannot use; one pair of test_hsdp.py runs took 95.0 and 87.3 s of CPU time, within this
# machine's noise). XLA's HLO passes, and so the program every test reads (its collectives,
# schedule and buffer assignment), are the defaults' (tests/project/test_test_setup.py). The
# machine code is not: results differ from the defaults' in rounding (the run and its oracle
# compile alike, so every comparison is like with like). -O0 broke that likeness: equal
# arithmetic in two programs was no longer bitwise equal (3 tests failed; by our reading,
# LLVM's -O0 instruction selector fuses a multiply and an add into an FMA in some kernels
# only). Measured: tests/core/test_hsdp.py takes 23 % less CPU time, an 8-H200 compile of
# the example GPT's stage 2 20 % less.
# JZERO_TEST_DEFAULT_CODEGEN=1 keeps XLA's defaults.
FAST_CODEGEN = (
    "--xla_backend_optimization_level=1",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_gpu_disable_gpuasm_optimizations=true",
    "--xla_cpu_parallel_codegen_split_count=1",
)
if not os.environ.get("JZERO_TEST_DEFAULT_CODEGEN"):
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_CODEGEN if f not in _flags])

import _ci_tier  # noqa: E402
import _durations  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# One persistent XLA compilation cache per test session, shared by the xdist workers (they
# start after this module is imported in the controller, and inherit its environment):
# the suite compiles the same programs many times over (the single-device Optax oracle of
# each parity case, a configuration's step in every test that checks one property of it),
# and a hit skips XLA's compile (tests/core/test_parity.py: a third less CPU time from a
# cold cache). An executable read back is the one written, so no assertion changes. XLA's
# own GPU caches stay off: a compile for GPUs that are not there keeps the options jzero
# gives it. Those compiles are written but cannot be read back (JAX's compile-only client
# cannot deserialize); pyproject.toml ignores JAX's warning for them, and they compile
# again, as without the cache. The processes tests start (the training scripts, the
# multi-process runs, the examples) read and write the same cache through JAX's
# environment variables: they compile the same steps as one another.
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
_CACHE_VAR = "JZERO_TEST_COMPILATION_CACHE"
_OWN_CACHE = _CACHE_VAR not in os.environ
if _OWN_CACHE:
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="jzero-test-xla-cache-")
_CACHE_CONFIG = {
    "jax_compilation_cache_dir": os.environ[_CACHE_VAR],
    "jax_persistent_cache_min_compile_time_secs": 0.25,
    "jax_persistent_cache_enable_xla_caches": "none",
}
for _name, _value in _CACHE_CONFIG.items():
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)  # for the processes tests start


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ[_CACHE_VAR], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks and xdist the groups
def pytest_collection_modifyitems(config, items):
    _ci_tier.mark_extended(items)
    if getattr(config.option, "loadgroup", False):  # --dist loadgroup (scripts/test.sh)
        one_worker_per_file(items)
        items[:] = _durations.longest_groups_first(items, _durations.recorded(DURATIONS))


def one_worker_per_file(items):
    """Each test file's tests on one xdist worker (``--dist loadgroup``, scripts/test.sh),
    unless a test names its group (a group several files share): a file's cached results
    (its single-device Optax oracles, its compiled steps, its module fixtures) are then
    computed once, where one test to a work unit computed them on both workers. xdist
    hands out the files with the most tests first. CI's tier, with the cache shared by
    the processes tests start and XLA:CPU's codegen in one piece (above): 3,184 s before,
    3,014 s after, on this 2-core machine (one clean-clone run each; identical runs of
    one file here differ by up to 25 %, so the three changes are not told apart)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_configure(config):
    if os.environ.get("JZERO_TEST_DURATIONS"):  # scripts/test_durations.py
        config.pluginmanager.register(_durations.Durations(os.environ["JZERO_TEST_DURATIONS"]))
