"""The package's structure: no import cycle, the step never imports the optimizer, JAX
internals and the jaxpr interpreter live in ``jzero.internal`` alone, and the library has
no import-time side effects; ``data_mesh`` says what mesh it built."""

from __future__ import annotations

import ast
import functools
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jzero

PACKAGE = pathlib.Path(jzero.__file__).parent


@functools.cache  # read-only: every test file's private imports are checked against it
def _imports() -> dict[str, set[str]]:
    """``{module: {modules it imports from the package}}``, from the source's relative and
    absolute ``jzero`` imports. ``from pkg import x`` imports ``pkg.x`` when ``x`` is a
    submodule, and ``pkg`` itself (its ``__init__``) for any other name."""
    parts = [p.relative_to(PACKAGE.parent).with_suffix("").parts for p in PACKAGE.rglob("*.py")]
    modules = {".".join(q[:-1] if q[-1] == "__init__" else q) for q in parts}
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
                    subs = {f"{mod}.{a.name}" for a in node.names}
                    deps.update(subs & modules)
                    if subs - modules:  # a name defined in mod (or its __init__)
                        deps.add(mod)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("jzero"))
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


@pytest.mark.smoke  # the package's floors
def test_no_import_cycle():
    graph = _imports()
    assert "jzero.core.train_step" in graph and "jzero.core.plan" in graph  # the walk saw them
    done, cycles = set(), []

    def visit(module, stack):
        if module in stack:
            cycles.append(stack[stack.index(module) :] + [module])
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def test_the_core_imports_nothing_above_it():
    """The core knows nothing of the optimizers users hold (``jzero.optimizers``), the
    adapters, the checkpointer, the accounting or the CLI: they ask it for plans and steps."""
    graph = _imports()
    assert "jzero.optimizers.zero_optimizer" in graph and "jzero.core.planning" in graph
    assert "jzero.core.planning" in graph["jzero.optimizers.zero_optimizer"]
    for module, deps in graph.items():
        if module.startswith("jzero.core"):
            allowed = ("jzero.core", "jzero._table", "jzero.internal")
            outside = {d for d in deps if not d.startswith(allowed)}
            assert outside == set(), module


def _package(token: str) -> str | None:
    """A package as jzero/README.md's table names it: ``jzero``, ``jzero.cli``, ``core``,
    ``__main__`` (``__init__.py`` names none)."""
    if token.endswith(".py"):
        return None
    return token if token == "jzero" or token.startswith("jzero.") else f"jzero.{token}"


def _allowed() -> dict[str, set[str]]:
    """jzero/README.md's table: ``{package: the packages it may import}`` (``{"*"}``:
    any)."""
    names = lambda cell: {p for t in re.findall(r"`([\w.]+)`", cell) if (p := _package(t))}
    table = {}
    for line in (PACKAGE / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may = {"*"} if "every package below" in cells[2] else names(cells[2])
        row = names(cells[0])  # packages of one row may import each other
        table |= {package: may | row for package in row}
    return table


def test_every_package_imports_only_what_its_readme_row_names():
    graph, allowed = _imports(), _allowed()
    top = lambda module: ".".join(module.split(".")[:2])
    assert {"jzero.core", "jzero.optimizers", "jzero.internal"} <= set(allowed)
    found = {}
    for module, deps in graph.items():
        package = top(module)
        assert package in allowed, f"{package} has no row in jzero/README.md"
        if "*" in allowed[package]:
            continue
        outside = {top(d) for d in deps} - allowed[package] - {package}
        if outside:
            found[module] = sorted(outside)
    assert found == {}, f"imports that jzero/README.md does not allow: {found}"


INTERNAL = "jzero.internal"


def _modules() -> dict[str, ast.Module]:
    """``{module name: its parsed source}`` for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(
            path.read_text()
        )
    return out


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain on a name; '' for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(names)]) if isinstance(node, ast.Name) else ""


def _jax_internal_uses(tree: ast.Module) -> list[str]:
    """Every import of, or attribute path into, ``jax._src`` / ``jax.extend`` in ``tree``."""
    private = ("jax._src", "jax.extend")
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        else:
            continue
        hits += [f"line {node.lineno}: {n}" for n in names if n.startswith(private)]
    return hits


def test_only_jzero_internal_touches_jax_internals():
    modules = _modules()
    assert f"{INTERNAL}.interpret" in modules and "jzero.core.train_step" in modules
    found = {
        name: hits
        for name, tree in modules.items()
        if not name.startswith(INTERNAL) and (hits := _jax_internal_uses(tree))
    }
    assert found == {}, (
        f"JAX internals outside {INTERNAL} (move them into {INTERNAL}, which holds every use "
        f"of jax._src / jax.extend): {found}"
    )
    # the check would see them: the boundary does use them
    assert _jax_internal_uses(modules[f"{INTERNAL}.primitives"])


_INTERPRETING = {"eqns", "bind", "get_bind_params", "ctx", "primitive", "source_info"}
"""Attributes only code that walks or re-binds a jaxpr's equations reads."""


def _interpreting(tree: ast.Module) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in _INTERPRETING
    }


def test_one_jaxpr_interpreter():
    """Only jzero.internal reads a jaxpr's equations, and only its ``interpret`` module binds
    them: every feature that re-runs a jaxpr is a set of rules for that one interpreter."""
    modules = _modules()
    outside = {
        name: attrs
        for name, tree in modules.items()
        if not name.startswith(INTERNAL) and (attrs := _interpreting(tree))
    }
    assert outside == {}, f"jaxpr equations read or bound outside {INTERNAL}: {outside}"
    binders = {
        name
        for name, tree in modules.items()
        if {"bind", "get_bind_params", "ctx"} & _interpreting(tree)
    }
    assert binders == {f"{INTERNAL}.interpret"}


_JAXPR_PARTS = {"invars", "outvars", "constvars", "make_jaxpr"}
"""A jaxpr's variables and its tracing: read through ``jzero.internal.equation``'s helpers
(``inputs``, ``outputs``, ``environment``, ``defined``, ``trace``) everywhere else."""


def _jaxpr_parts(tree: ast.Module) -> set[str]:
    found = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return found & _JAXPR_PARTS


def test_jaxprs_are_read_through_the_boundary():
    """Outside jzero.internal no module reads a jaxpr's variables or traces one itself."""
    modules = _modules()
    outside = {
        name: parts
        for name, tree in modules.items()
        if not name.startswith(INTERNAL) and (parts := _jaxpr_parts(tree))
    }
    assert outside == {}, f"jaxprs read outside {INTERNAL} (use its helpers): {outside}"
    assert _jaxpr_parts(modules[f"{INTERNAL}.equation"]) == _JAXPR_PARTS  # the check sees them


def test_the_boundary_imports_nothing_else_from_jzero():
    """jzero.internal is a leaf: the rest of jzero builds on it, never the other way."""
    graph = _imports()
    for module, deps in graph.items():
        if module.startswith(INTERNAL):
            assert {d for d in deps if not d.startswith(INTERNAL)} == set(), module


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


TESTS = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = {
    "jzero",
    "jzero.linen",
    "jzero.nnx",
    "jzero.checkpoint",
    "jzero.distributed",
    "jzero.accounting",
    "jzero.accounting.memory_spaces",
    "jzero.config",
    "jzero.cli",
    "jzero.autoconfig",
}
"""The modules the API reference documents: what a user imports."""
FLOORS = {
    "internal": 1,
    "core": 2,
    "accounting": 3,
    "adapters": 3,
    "checkpoint": 3,
    "config": 3,
    "distributed": 3,
    "autoconfig": 4,
    "cli": 5,
}
"""The package's areas, each above what it imports (``project``: scripts, examples and docs,
above them all)."""


def _test_files() -> list[pathlib.Path]:
    return [p for p in TESTS.rglob("*.py") if "vendor" not in p.relative_to(TESTS).parts]


def _private_imports(tree: ast.Module) -> set[str]:
    """The non-public jzero modules ``tree`` imports or reaches by attribute."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Attribute) and (dotted := _dotted(node)).startswith("jzero."):
            found.update(".".join(dotted.split(".")[:k]) for k in (2, 3))
    modules = _imports().keys()
    private = {m for m in found if m.startswith("jzero.") and m not in PUBLIC}
    return {m for m in private if m in modules}


def test_tests_import_the_public_api_or_say_whose_internals_they_test():
    """A test importing a module the API reference does not document lives in the folder of
    that module's area, or of an area above it (``tests/core/...`` may import
    ``jzero.core.*`` and ``jzero.internal.*``); ``tests/project`` may import anything."""
    wrong = {}
    for path in _test_files():
        folder = path.relative_to(TESTS).parts[:-1]
        area = folder[0] if folder else None
        for module in _private_imports(ast.parse(path.read_text())):
            theirs = module.split(".")[1]
            if area == "project":
                continue
            if area not in FLOORS or not (theirs == area or FLOORS[theirs] < FLOORS[area]):
                wrong.setdefault(str(path.relative_to(TESTS)), []).append(module)
    assert wrong == {}, (
        f"tests importing another area's internals (move them, or import jzero): {wrong}"
    )
    assert _private_imports(ast.parse("import jzero.core.plan\nfrom jzero import Plan")) == {
        "jzero.core.plan"
    }


def test_tests_mirror_the_package():
    """A folder per area of the package (``core``'s subpackages included), beside
    ``project`` (scripts, examples, docs), ``workers`` (subprocess scripts) and ``vendor``."""
    areas = {p.parent.relative_to(TESTS) for p in TESTS.rglob("test_*.py")}
    areas = {a for a in areas if a.parts and a.parts[0] != "vendor"}
    packages = {p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("__init__.py")}
    assert all(a in packages or a == pathlib.Path("project") for a in areas), areas
    assert not list(TESTS.glob("test_*.py")), "a test at the top of tests/: put it in its area"
