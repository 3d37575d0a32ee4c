"""What the GPU check's pieces share: targets, the piece's clock, the machine's
description, and random-token batches for ``examples/gpt.py``'s GPT family.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import gpt  # examples/gpt.py
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

STATUSES = ("PASS", "FAIL", "SKIP")


def target(name: str, ok: bool, text: str, *, measured: Any, bound: Any) -> dict[str, Any]:
    """A target checked: PASS or FAIL, what was measured against which bound."""
    status = "PASS" if ok else "FAIL"
    return {"name": name, "status": status, "text": text, "measured": measured, "bound": bound}


def skip(name: str, reason: str) -> dict[str, Any]:
    """A target not checked, and why (``reason`` starts with ``skipped:``)."""
    return {"name": name, "status": "SKIP", "reason": reason}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """What a piece knows about its run."""

    dry_run: bool
    """CPU at tiny sizes: the code paths, not the figures."""
    gpu: bool
    """A GPU is the default backend (never under ``dry_run``)."""


def host_memory_bytes() -> int:
    """Physical memory of this machine (``MemTotal``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine() -> dict[str, Any]:
    """The jax version, the devices (kind, count, allocator limit), host memory, and the
    environment variables that shape the measurements."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}  # None on CPU
    env = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "device_bytes_limit": stats.get("bytes_limit"),
        "host_memory_bytes": host_memory_bytes(),
        "cpu_count": os.cpu_count(),
        "env": {name: os.environ.get(name) for name in env},
    }


def gpt_config(sizes: dict[str, int], *, layers: int | None = None, dtype=jnp.float32):
    """The family's GPT at ``sizes`` (``d_model``, ``heads``, ``seq_len``, ``vocab``,
    ``layers``)."""
    return gpt.GPTConfig(
        vocab_size=sizes["vocab"], seq_len=sizes["seq_len"], d_model=sizes["d_model"],
        n_heads=sizes["heads"], n_layers=layers or sizes["layers"], dtype=dtype,
    )  # fmt: skip


def random_batches(mesh, cfg, *, batch: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` batches of random tokens ``[batch, seq_len + 1]``, on the mesh's 'data'."""
    sharding = NamedSharding(mesh, P("data"))
    key = jax.random.key(seed)
    shape = (batch, cfg.seq_len + 1)
    return [
        {"tokens": jax.device_put(jax.random.randint(k, shape, 0, cfg.vocab_size), sharding)}
        for k in jax.random.split(key, count)
    ]
