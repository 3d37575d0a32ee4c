"""What each test costs, for the durations table (scripts/test_durations.py writes
tests/durations.md from it): with ``JZERO_TEST_DURATIONS=<folder>`` set, every pytest
process of the run (the controller and each xdist worker) appends one JSON line per test
to ``<folder>/<pid>.jsonl``: its node id, its seconds (setup, call and teardown) and the
XLA compiles it made in that process, for the CPU and for compile-only GPUs.

A compile is counted from JAX's public monitoring event for a backend compile (a
persistent-cache hit counts too: it is where a compile was asked for), and is a GPU one
where ``jax.stages.Lowered.compile`` returned an executable for GPU devices (a compile for
GPUs that are not there goes through ``.lower().compile()`` only). Compiles in the
processes a test starts (the training scripts, the multi-process runs) are not counted.

The recorded seconds per file (tests/durations.json) order the next runs' files, longest
first (:func:`longest_groups_first`, applied in tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import jax
import pytest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Durations:
    """The pytest plugin: one record per test, appended as the test ends."""

    def __init__(self, folder: str):
        self.out = Path(folder) / f"{os.getpid()}.jsonl"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.compiles = {"cpu": 0, "gpu": 0}
        self.gpu_programs: list[str] = []  # the current test's, by _program
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._wrap_lowered_compile()

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.compiles["cpu"] += 1  # moved to "gpu" by the wrapper below

    def _wrap_lowered_compile(self) -> None:
        compile_ = jax.stages.Lowered.compile

        def counted(lowered, *args, **kwargs):
            before = self.compiles["cpu"]
            compiled = compile_(lowered, *args, **kwargs)
            if _on_gpus(compiled) and self.compiles["cpu"] > before:  # XLA compiled it here
                self.compiles["gpu"] += self.compiles["cpu"] - before
                self.compiles["cpu"] = before
                self.gpu_programs.append(_program(lowered, compiled))
            return compiled

        jax.stages.Lowered.compile = counted

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, start = dict(self.compiles), time.perf_counter()
        self.gpu_programs = []
        yield
        record = {
            "test": item.nodeid.split("@")[0],  # less xdist's group
            "seconds": round(time.perf_counter() - start, 3),
            "ended": round(time.time(), 1),  # when, to see each worker's timeline
            **{k: self.compiles[k] - before[k] for k in self.compiles},
            "gpu_programs": self.gpu_programs,
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _program(lowered, compiled) -> str:
    """A GPU compile's program and target: a hash of the lowered text, the GPUs' kind and
    count. ``jax.jit``'s ``compiler_options`` are not in it (no public object shows them):
    the same key twice is the same text, perhaps compiled with other options."""
    devices = _devices(compiled)
    kind = next(iter(devices)).device_kind if devices else "?"
    digest = hashlib.sha1(lowered.as_text().encode()).hexdigest()[:12]
    return f"{digest} on {len(devices)} x {kind}"


def _devices(compiled) -> set:
    shardings = jax.tree.leaves(compiled.input_shardings)
    return next((s.device_set for s in shardings if hasattr(s, "device_set")), set())


def _on_gpus(compiled) -> bool:
    return any(d.platform == "gpu" for d in _devices(compiled))


def recorded(path: str) -> dict[str, float]:
    """Seconds per test file of the last recorded run (scripts/test_durations.py writes
    them to tests/durations.json); empty where there is none."""
    try:
        with open(path) as f:
            return json.load(f)["seconds_per_file"]
    except (OSError, ValueError, KeyError):
        return {}


def longest_groups_first(items, seconds: dict[str, float]) -> list:
    """The items, their xdist groups in order of recorded time, longest first (a group the
    record does not know first of all): scripts/test.sh runs them in that order
    (``--no-loadscope-reorder``), so the last to start are the shortest and neither
    worker waits long for the other at the end (LPT scheduling). A group's time is its
    files' recorded seconds, shared among their tests (tests/durations.json)."""
    per_file: dict[str, int] = {}
    for item in items:
        per_file[_file(item)] = per_file.get(_file(item), 0) + 1
    groups: dict[str, list] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        groups.setdefault(mark.args[0] if mark.args else mark.kwargs["name"], []).append(item)
    cost = lambda group: sum(
        seconds.get(_file(i), float("inf")) / per_file[_file(i)] for i in group
    )
    return [i for g in sorted(groups.values(), key=cost, reverse=True) for i in g]


def _file(item) -> str:
    return item.nodeid.split("::")[0]
