"""The declared version range is the tested one: floors equal ci/oldest-pins.txt, every
core dependency has a ceiling, and the versions installed lie inside the range."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest
from _paths import REPO
from packaging.requirements import Requirement
from packaging.version import Version

PINNED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "safetensors")


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = (Requirement(r) for r in project["dependencies"])
    return {r.name: r for r in reqs}


def _pins() -> dict[str, Version]:
    lines = (REPO / "ci" / "oldest-pins.txt").read_text().splitlines()
    pins = (re.fullmatch(r"([\w.-]+)==([\w.]+)", ln.strip()) for ln in lines)
    return {m[1]: Version(m[2]) for m in pins if m}


def _bounds(req: Requirement) -> tuple[Version | None, Version | None]:
    floor = [Version(s.version) for s in req.specifier if s.operator == ">="]
    ceiling = [Version(s.version) for s in req.specifier if s.operator == "<"]
    return (floor[0] if floor else None), (ceiling[0] if ceiling else None)


@pytest.mark.parametrize("name", PINNED)
def test_floor_is_the_oldest_pin_and_a_ceiling_is_declared(name):
    floor, ceiling = _bounds(_requirements()[name])
    assert floor == _pins()[name], f"{name}: pyproject floor {floor} != oldest pin"
    assert ceiling is not None and ceiling > floor, f"{name} declares no ceiling"


@pytest.mark.parametrize("name", PINNED)
def test_installed_version_is_inside_the_declared_range(name):
    installed = importlib.metadata.version(name)
    assert _requirements()[name].specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is outside {_requirements()[name].specifier}"
    )
