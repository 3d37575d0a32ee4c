"""Where things are, for tests in any folder: the repository, the tests, their workers
(scripts run in subprocesses) and the examples."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKERS = TESTS / "workers"
EXAMPLES = REPO / "examples"
VENDOR = TESTS / "vendor"


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (``examples/`` on ``sys.path``, as the
    scripts put it themselves)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(EXAMPLES))
    if name in sys.modules:  # once per process: a script's module-level work runs once
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _gpu_plugin() -> str:
    """The module of JAX's CUDA plugin installed here: CUDA 13's (jax 0.12.1 ships no
    other), else CUDA 12's (the gpu-compile extra's); CUDA 13's name where none is (a test
    needing it then skips)."""
    import importlib.util

    found = [
        m
        for m in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
        if importlib.util.find_spec(m)
    ]
    return found[0] if found else "jax_plugins.xla_cuda13"


GPU_PLUGIN = _gpu_plugin()
