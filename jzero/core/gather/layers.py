"""An unrolled model's layers, found from its parameters: where a remat policy recomputes.

Stage 3's default gathering (:mod:`.autogather`) gathers each parameter of an unrolled
model at its use and keeps every activation. With ``StepOptions(remat_policy=...)`` the
user asks backward to recompute activations instead, and that saves memory only a layer
at a time: a whole-loss checkpoint would recompute the whole forward at once. A scan's
step and a ``jax.checkpoint`` region are layers already; an unrolled model's layers are
found here, without ``layers=`` and without an edit to the model:

- :func:`layer_of`: the parameter leaves that repeat -- siblings named ``blocks_0``,
  ``blocks_1``, ... (Flax Linen's submodule names) or ``[0]``, ``[1]``, ... (a list of
  layer dicts, an NNX ``nnx.List``) whose subtrees have the same structure and shapes --
  and which layer each belongs to;
- :func:`layer_gaps`: between which equations of the loss each layer's span may start
  (after the previous layer's last parameter read, before its own first), provided the
  layers are read in turn; :mod:`.autogather` cuts each gap where the fewest bytes cross
  (the residual stream, typically).

Each span then runs as one :func:`jzero.remat_layer` with the policy.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence
from typing import Any

_NUMBERED = re.compile(r"^(.*?)_?(\d+)$")


def layer_of(paths: Sequence[tuple], shapes: Sequence[tuple]) -> list[int | None]:
    """For each leaf (its key path, as from ``jax.tree_util.tree_flatten_with_path``, and
    its shape), the number of the repeated layer it belongs to, or None: the group of
    numbered siblings with identical subtrees covering the most leaves (the shallowest of
    equals)."""
    paths = [tuple(_key(k) for k in path) for path in paths]
    best: tuple[int, int, tuple] | None = None
    for depth, group, members in _groups(paths):
        if len(members) < 2 or not _alike(members, paths, shapes, depth):
            continue
        covered = sum(len(v) for v in members.values())
        if best is None or (covered, -depth) > (best[0], -best[1]):
            best = (covered, depth, group)
    if best is None:
        return [None] * len(paths)
    _, depth, group = best
    out: list[int | None] = [None] * len(paths)
    for i, path in enumerate(paths):
        if len(path) > depth and (path[:depth], _stem(path[depth])) == group:
            out[i] = _number(path[depth])
    return out


def layer_gaps(
    layers: Sequence[int | None], reads: Mapping[int, Sequence[int]], n_eqns: int
) -> list[tuple[int, int]]:
    """Where each layer's span of equations may start, and the last may stop: ``L + 1``
    ranges ``(lo, hi)`` of cut positions, given each leaf's layer (:func:`layer_of`), the
    equation numbers that read it (``reads``: by leaf position) and the loss's number of
    equations. Layer ``i``'s span starts after the last read of layer ``i - 1`` (or of
    whatever parameter comes before) and no later than its own first read. Empty unless
    every layer is read and the layers are read one after another."""
    firsts: dict[int, int] = {}
    lasts: dict[int, int] = {}
    others: list[int] = []  # reads of parameters outside the layers
    for leaf, layer in enumerate(layers):
        if layer is None:
            others.extend(reads.get(leaf, ()))
        elif reads.get(leaf):
            firsts[layer] = min(firsts.get(layer, n_eqns), min(reads[leaf]))
            lasts[layer] = max(lasts.get(layer, -1), max(reads[leaf]))
    order = sorted(firsts, key=firsts.__getitem__)
    if len(order) < 2 or len(order) != len({x for x in layers if x is not None}):
        return []
    starts, ends = [firsts[n] for n in order], [lasts[n] for n in order]
    if any(e >= s for e, s in zip(ends, starts[1:])):
        return []  # layers interleaved: no span holds one layer's reads alone
    if any(starts[0] <= r <= ends[-1] and not _within(r, starts, ends) for r in others):
        return []  # another parameter read between two layers: keep the default
    lo = max((r + 1 for r in others if r < starts[0]), default=0)
    hi = min((r for r in others if r > ends[-1]), default=n_eqns)
    return [(lo, starts[0])] + [(e + 1, s) for e, s in zip(ends, starts[1:])] + [(ends[-1] + 1, hi)]


def _within(r: int, starts: list[int], ends: list[int]) -> bool:
    return any(s <= r <= e for s, e in zip(starts, ends))


def _key(k: Any) -> Any:
    """A path entry as a plain name or index."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _stem(k: Any) -> str | None:
    """``'blocks'`` for ``'blocks_3'``; ``''`` for an index; None if not numbered."""
    if isinstance(k, int):
        return ""
    m = _NUMBERED.match(str(k))
    return m.group(1) if m else None


def _number(k: Any) -> int:
    return k if isinstance(k, int) else int(_NUMBERED.match(str(k)).group(2))


def _groups(paths: list[tuple]) -> list[tuple[int, tuple, dict[Any, list[int]]]]:
    """``(depth, (parent path, stem), {member name: leaf positions})`` for every set of
    numbered siblings."""
    groups: dict[tuple[int, tuple], dict[Any, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for i, path in enumerate(paths):
        for depth, k in enumerate(path[:-1]):
            if (stem := _stem(k)) is not None:
                groups[depth, (path[:depth], stem)][k].append(i)
    return [(d, g, dict(m)) for (d, g), m in groups.items()]


def _alike(members: dict[Any, list[int]], paths: list[tuple], shapes: list, depth: int) -> bool:
    """Whether the members' subtrees have the same paths below them and the same shapes."""
    forms = {
        tuple((paths[i][depth + 1 :], shapes[i]) for i in leaves) for leaves in members.values()
    }
    return len(forms) == 1
