"""Readable, stable names for the leaves of a pytree: ``"layers.w"``, ``"0.mu.emb"``.

Checkpoints and exports store leaves under these names (the dotted paths PyTorch and
safetensors users know), so a file never depends on Python object identities and a reader
can tell which leaf is which.
"""

from __future__ import annotations

from typing import Any

import jax


def _key(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_names(tree: Any, *, is_leaf: Any = None) -> list[str]:
    """One name per leaf of ``tree`` (a pytree or a ``PyTreeDef``), in ``jax.tree.leaves``
    order: its key path joined with ``'.'`` (dict keys, sequence indices, attribute
    names), e.g. ``{"blocks": [{"kernel": x}]}`` -> ``"blocks.0.kernel"``. A lone leaf
    is ``''``.

    Raises:
        ValueError: two leaves get the same name (e.g. keys ``'a.b'`` and ``a`` -> ``b``).
    """
    if isinstance(tree, jax.tree_util.PyTreeDef):
        tree = jax.tree.unflatten(tree, [0] * tree.num_leaves)
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    names = [".".join(_key(k) for k in path) for path, _ in paths]
    seen: dict[str, str] = {}
    for (path, _), name in zip(paths, names):
        if name in seen:
            raise ValueError(
                f"leaves {seen[name]} and {jax.tree_util.keystr(path)} both get the name "
                f"{name!r}; rename one of the keys so that no two key paths joined with '.' "
                "agree."
            )
        seen[name] = jax.tree_util.keystr(path)
    return names


def unflatten_names(named: dict[str, Any]) -> dict[str, Any]:
    """``{'a.b': x, 'a.c': y}`` -> ``{'a': {'b': x, 'c': y}}`` (nested dicts only)."""
    out: dict[str, Any] = {}
    for name, value in named.items():
        node = out
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
