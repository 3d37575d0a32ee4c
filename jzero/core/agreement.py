"""Before a multi-process step's first collective: every process runs the same step.

Processes launched with different settings -- one at stage 3 and one at stage 2, or with
different local batch shapes -- compile different programs whose collectives do not match:
each blocks in its first collective until gloo/NCCL time out and then blames a lost peer
(or aborts in a C++ check). :class:`Agreement` compares the run's configuration across
processes before that: the stage, the mesh (shape, axis names and types, device ids), the
precision policy, the step's options, a summary of the plan and the batch's leaves (dtype,
global shape, sharding, this process's part).

The comparison cannot itself hang on a mismatch: every process gathers one fixed-size
array -- a 32-byte sha256 of each of the fixed list of fields -- so the gather has the
same shape everywhere whatever the configurations are. Only when the digests differ do the
processes gather the readable descriptions as well (padded to the longest, whose length
every process learnt from the first gather), so every process raises the same error, which
names each differing field and which processes hold which value. It runs once per new
(plan, batch layout), i.e. once per compiled program, never per step. A process that
changes its batch shape later while the others keep theirs is not caught (it would need a
collective every step).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from .options.zero_config import ZeroConfig

FIXES = {
    "stage": "start every process with the same stage=",
    "mesh": "build the same mesh on every process (same axes, shape and device order)",
    "precision": "pass the same jzero.Precision on every process",
    "step options": (
        "build the optimizer and the step with the same comm=, offload= and train_step "
        "options on every process"
    ),
    "plan": (
        "give every process the same parameter shapes and dtypes, Optax transformation, "
        "param_specs, min_shard_size and offload settings"
    ),
    "batch": (
        "pass every process a batch with the same leaves, dtypes and number of local rows, "
        "e.g. jzero.distributed.global_batch(mesh, rows) with as many rows on each process"
    ),
}
"""The fields compared, in order, each with the fix for a mismatch."""

_DIGEST = 32  # bytes of sha256
_READABLE = 300  # characters of a field's value shown in the error


class Agreement:
    """A step's check that every process runs it with the same configuration.

    Args:
        config, mesh: the step's configuration and mesh.
    """

    def __init__(self, config: ZeroConfig, mesh: Mesh):
        options = {"options": config.step, "comm": config.comm, "offload": config.offload}
        self._static = {
            "stage": str(config.stage),
            "mesh": _describe_mesh(mesh),
            "precision": repr(config.precision),
            "step options": ", ".join(f"{k}={v!r}" for k, v in options.items()),
        }
        self._agreed: set[Any] = set()

    def check(self, state: Any, batch: Any) -> None:
        """Raises ``ValueError`` on every process if any field differs between processes;
        no-op in a single-process run and for a (plan, batch layout) already agreed on."""
        if jax.process_count() == 1:
            return
        plan = getattr(state, "plan", None)
        key = (plan, _batch_key(batch))
        if key in self._agreed:
            return
        fields = {**self._static, "plan": _describe_plan(plan), "batch": _describe_batch(batch)}
        check_processes_agree(fields)
        self._agreed.add(key)


def check_processes_agree(fields: dict[str, str]) -> None:
    """Every process passes the same ``fields`` (one text per name of :data:`FIXES`), else
    every process raises the same ``ValueError`` naming the differing fields."""
    texts = [_without_addresses(fields[name]) for name in FIXES]  # fixed order and count
    readable = json.dumps([_short(t) for t in texts]).encode()
    digests = np.frombuffer(b"".join(_sha256(t) for t in texts), np.uint8)
    length = np.frombuffer(np.uint32(len(readable)).tobytes(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(np.concatenate([digests, length])))
    every_digest = every[:, :-4].reshape(len(every), len(FIXES), _DIGEST)  # [process, field]
    if (every_digest == every_digest[0]).all():
        return
    longest = int(every[:, -4:].copy().view(np.uint32).max())
    mine = np.zeros(longest, np.uint8)
    mine[: len(readable)] = np.frombuffer(readable, np.uint8)
    texts = np.asarray(multihost_utils.process_allgather(mine))  # [process, longest]
    values = [json.loads(t.tobytes().rstrip(b"\0")) for t in texts]  # [process][field]
    raise ValueError(_mismatch_message(list(FIXES), every_digest, values))


def _mismatch_message(names: list[str], digests: np.ndarray, values: list[list[str]]) -> str:
    lines = []
    for f, name in enumerate(names):
        groups: dict[bytes, list[int]] = {}
        for p in range(len(values)):
            groups.setdefault(digests[p, f].tobytes(), []).append(p)
        if len(groups) == 1:
            continue
        held = "; ".join(f"{_processes(ps)}: {values[ps[0]][f]}" for ps in groups.values())
        lines.append(f"- {name!r} differs: {held}. Fix: {FIXES[name]}.")
    return (
        f"the {len(values)} processes of this run are not running the same training step "
        "(compared before its first collective, which would hang until a timeout):\n"
        + "\n".join(lines)
    )


def _processes(ids: list[int]) -> str:
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return ("process " if len(ids) == 1 else "processes ") + text


def _without_addresses(text: str) -> str:
    """``text`` without object addresses (``<function f at 0x7f...>`` in a treedef's
    repr), which differ between processes running the same program."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _short(text: str) -> str:
    """``text`` as shown in the error: its first line, at most :data:`_READABLE` characters,
    with its digest when anything was left out."""
    first = text.split("\n", 1)[0]
    if first == text and len(text) <= _READABLE:
        return text
    return f"{first[: _READABLE - 40]} ... (sha256 {_sha256(text).hex()[:12]})"


def _describe_mesh(mesh: Mesh) -> str:
    types = ", ".join(str(t) for t in mesh.axis_types)
    ids = [int(d.id) for d in mesh.devices.flat]
    return f"{dict(mesh.shape)} ({types}), device ids {ids}"


def _describe_plan(plan: Any) -> str:
    """A summary line, then everything the plan places (its table and trees)."""
    if not hasattr(plan, "params"):
        return f"no plan ({type(plan).__name__})"
    elements = sum(int(np.prod(s.layout.shape)) for s in plan.params)
    dtypes = sorted({str(s.dtype) for s in plan.params})
    split = lambda stored: sum(s.partitioned for s in stored)
    summary = (
        f"{len(plan.params)} parameter leaves ({elements} elements, {'/'.join(dtypes)}, "
        f"{split(plan.params)} stored partitioned), {len(plan.opt)} optimizer-state leaves "
        f"({split(plan.opt)} partitioned)"
    )
    return "\n".join([summary, plan.describe(), repr(plan)])


def _describe_batch(batch: Any) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    parts = [f"{jax.tree_util.keystr(path)}: {_describe_leaf(x)}" for path, x in leaves]
    return "; ".join(parts) + f" (tree {jax.tree.structure(batch)})"


def _describe_leaf(x: Any) -> str:
    shape, dtype = list(getattr(x, "shape", ())), getattr(x, "dtype", type(x).__name__)
    if not isinstance(x, jax.Array):
        return f"{type(x).__name__} {dtype}{shape}"
    spec = getattr(x.sharding, "spec", type(x.sharding).__name__)
    return f"{dtype}{shape} as {spec}, this process's part {_local_shape(x)}"


def _local_shape(x: jax.Array) -> list[int]:
    """The shape of the part of ``x`` this process's devices hold, e.g. its rows."""
    indices = {tuple((s.start, s.stop) for s in shard.index) for shard in x.addressable_shards}
    shape = []
    for d, size in enumerate(x.shape):
        slices = {index[d] for index in indices}
        shape.append(sum(len(range(*slice(*s).indices(size))) for s in slices))
    return shape


def _batch_key(batch: Any) -> Any:
    leaves, treedef = jax.tree.flatten(batch)
    key = lambda x: (type(x), getattr(x, "shape", None), str(getattr(x, "dtype", None)))
    shardings = tuple(x.sharding if isinstance(x, jax.Array) else None for x in leaves)
    return treedef, tuple(key(x) for x in leaves), shardings
