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
"""

from __future__ import annotations

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
        self.started: dict[str, tuple[float, dict]] = {}
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
            if _on_gpus(compiled):  # what XLA compiled here (not JAX's in-memory cache)
                self.compiles["gpu"] += self.compiles["cpu"] - before
                self.compiles["cpu"] = before
            return compiled

        jax.stages.Lowered.compile = counted

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, start = dict(self.compiles), time.perf_counter()
        yield
        record = {
            "test": item.nodeid.split("@")[0],  # less xdist's group
            "seconds": round(time.perf_counter() - start, 3),
            **{k: self.compiles[k] - before[k] for k in self.compiles},
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _on_gpus(compiled) -> bool:
    shardings = jax.tree.leaves(compiled.input_shardings)
    devices = next((s.device_set for s in shardings if hasattr(s, "device_set")), set())
    return any(d.platform == "gpu" for d in devices)
