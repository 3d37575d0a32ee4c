"""The package's structure: no import cycle, the step never imports the optimizer, and the
library has no import-time side effects; ``data_mesh`` says what mesh it built."""

from __future__ import annotations

import ast
import logging
import os
import pathlib
import subprocess
import sys

import jzero

PACKAGE = pathlib.Path(jzero.__file__).parent


def _imports() -> dict[str, set[str]]:
    """``{module: {modules it imports from the package}}``, from the source's relative and
    absolute ``jzero`` imports (``from . import x`` counts as importing ``pkg.x``)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.startswith("jzero"):
                    deps.add(mod)
                    deps.update(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("jzero"))
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycle():
    graph = _imports()
    assert "jzero.core.step" in graph and "jzero.core.plan" in graph  # the walk saw them
    done, cycles = set(), []

    def visit(module, stack):
        if module in stack:
            cycles.append(stack[stack.index(module) :] + [module])
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            # a package's __init__ re-exporting its submodules is not a cycle with them
            if not module.startswith(dep + "."):
                visit(dep, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def test_step_does_not_import_the_optimizer():
    graph = _imports()
    assert "jzero.core.optimizer" not in graph["jzero.core.step"]
    assert "jzero.core.optimizer" not in graph["jzero.core.placement"]
    # the core knows nothing of the adapters, the accounting or the CLI
    for module, deps in graph.items():
        if module.startswith("jzero.core"):
            outside = {d for d in deps if not d.startswith(("jzero.core", "jzero._table"))}
            assert outside == set(), module


def test_import_sets_no_config_and_no_xla_flags():
    code = (
        "import os, jax; before = (os.environ.get('XLA_FLAGS'), jax.config.jax_num_cpu_devices);"
        "import jzero, jzero.linen, jzero.nnx;"
        "assert (os.environ.get('XLA_FLAGS'), jax.config.jax_num_cpu_devices) == before;"
        "assert jzero.linen.TrainState and jzero.nnx.TrainState; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_data_mesh_logs_the_mesh(caplog):
    with caplog.at_level(logging.INFO, logger="jzero"):
        mesh = jzero.data_mesh()
    assert mesh.shape["data"] == 8
    assert [r.getMessage() for r in caplog.records] == [
        "jzero.data_mesh: 'data' axis over 8 cpu device(s)"
    ]


def test_data_mesh_on_one_cpu_says_how_to_get_more():
    code = "import jax, jzero; print(jzero.data_mesh().shape['data'])"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert "only one CPU device" in out.stderr
    assert 'jax.config.update("jax_num_cpu_devices", N)' in out.stderr
