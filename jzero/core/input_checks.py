"""Input checks: every bad input gets an error that names the leaf, the problem and the fix.

They run before anything is placed or traced (or at trace time, on shapes only), so a
refused call changes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from .checksum import checksums
from .memory_kinds import check_memory
from .options.zero_config import ZeroConfig
from .plan import ZeroState

_ARRAY = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def check_leaves(tree: Any, what: str, *, allow_empty: bool = True) -> None:
    """Every leaf of ``tree`` is an array or shape (real, complex, or typed PRNG keys)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves and not allow_empty:
        raise ValueError(
            f"{what} is empty (no array leaves), so there is nothing to train; pass the "
            "model's parameters, e.g. model.init(key, x)['params']."
        )
    for path, leaf in leaves:
        if not isinstance(leaf, _ARRAY):
            raise TypeError(
                f"{leaf_name(what, path)} is {article(type(leaf).__name__)}, not an array; "
                "jzero shards arrays only. Convert it with jnp.asarray(...) or keep it out of "
                "the parameter tree (e.g. as a static config)."
            )


def check_complex(params: Any, opt_state: Any, config: Any) -> None:
    """Complex leaves train at every stage, but not where a path is real-only: quantized
    collectives and hpZ's gather (their quantizers and rounding take real numbers) read the
    parameters, offload's host step the state too. Raises naming the leaf and the option."""
    comm, offload = config.comm, config.offload
    weights, both = [("params", params)], [("params", params), ("optimizer state", opt_state)]
    on = [
        ("Communication(grad_quant=...)", comm.grad_quant is not None, weights),
        ("Communication(gather_quant=...)", comm.gather_quant is not None, weights),
        ("Communication(hpz=...)", comm.hpz is not None, weights),
        ("Offload(...)", offload.offloads, both),
    ]
    for option, trees in ((option, trees) for option, used, trees in on if used):
        for what, tree in trees:
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                    raise NotImplementedError(
                        f"{leaf_name(what, path)} is {leaf.dtype}, and {option} works on real "
                        "numbers only. Leave that option out (complex leaves train at every "
                        "stage without it), or store the real and imaginary parts as two real "
                        "leaves and combine them in the loss (jax.lax.complex(re, im))."
                    )


def leaf_name(what: str, path: Any) -> str:
    """How a message names the leaf at ``path`` of the tree ``what``: ``params['w']``, or
    ``params`` itself where the tree is one array."""
    return f"{what} leaf {jax.tree_util.keystr(path)}" if path else f"{what} (one array)"


def article(noun: str) -> str:
    """``noun`` with its indefinite article: "an ArrayImpl", "a dict"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def check_same_tree(given: Any, expected: Any) -> None:
    """``given`` (params or their shapes) matches what ``init_fn`` returns."""
    gd, ed = jax.tree.structure(given), jax.tree.structure(expected)
    if gd != ed:
        raise ValueError(
            f"params tree {gd} does not match the tree init_fn returns {ed}; pass matching "
            "shapes, or only init_fn=."
        )
    for (path, g), e in zip(
        jax.tree_util.tree_flatten_with_path(given)[0], jax.tree.leaves(expected)
    ):
        if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype:
            raise ValueError(
                f"params leaf {jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but "
                f"init_fn returns {e.dtype}{list(e.shape)}; make them agree."
            )


def check_state(
    state: Any, config: ZeroConfig, *, mesh: Any, tx: optax.GradientTransformation | None
) -> None:
    """``state`` was made by an optimizer of this configuration's stage, precision and
    offload, on ``mesh``, and (if given) of this Optax transformation; its trees still match
    its plan, and every leaf is in the memory the plan stores it in (:func:`check_memory`)."""
    stage, mixed = config.stage, config.precision.mixed
    if not isinstance(state, ZeroState):
        raise TypeError(f"expected a jzero.ZeroState from opt.init(...), got {type(state)}.")
    plan = state.plan
    if plan.stage != stage or plan.mesh != mesh:
        raise ValueError(
            f"state was made for stage {plan.stage} on {plan.data_size} devices "
            f"({dict(plan.mesh.shape)}), but this optimizer is stage {stage} on "
            f"{mesh.shape['data']} ({dict(mesh.shape)}); create the state with this "
            "optimizer's init()."
        )
    if (plan.master is not None) != mixed:
        raise ValueError(
            "state was made with a different precision policy than this optimizer's "
            f"(fp32 master weights: {plan.master is not None}, expected {mixed}); create the "
            "state with this optimizer's init()."
        )
    if jax.tree.structure(state.params) != plan.params_def:
        raise ValueError(
            "state.params does not match the parameter tree given to init() "
            f"(got {jax.tree.structure(state.params)}, expected {plan.params_def}); "
            "re-run opt.init(params) after changing the model."
        )
    check_memory(state)
    if tx is None:
        return
    shapes = [jax.ShapeDtypeStruct(s.layout.shape, jnp.float32) for s in plan.params]
    expected = jax.tree.structure(jax.eval_shape(tx.init, plan.params_def.unflatten(shapes)))
    if expected != plan.opt_def:
        raise ValueError(
            "state.opt_state was made by a different Optax transformation than this "
            f"optimizer's (its state is {_short(plan.opt_def)}, this optimizer's tx.init "
            f"gives {_short(expected)}); create the state with this optimizer's init(), or "
            "build the optimizer with the transformation the state came from."
        )


def check_live(state: ZeroState) -> None:
    """Refuses a state whose buffers were donated to (consumed by) an earlier step."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        if concrete and x.is_deleted():
            raise ValueError(
                f"state leaf {jax.tree_util.keystr(path)} was deleted: this state was donated "
                "to (consumed by) an earlier train_step, which reuses its buffers for the "
                "state it returns. Use the returned state (state, metrics = step(state, "
                "batch)), or build the step with donate=False to keep the old one."
            )


def check_batch(batch: Any, n: int, grad_accum: int) -> None:
    """Every batch leaf has the same leading (batch) dimension, splitting evenly over the
    ``n`` devices and their ``grad_accum`` micro-batches."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError("batch is empty; pass a pytree of arrays with a leading batch axis.")
    rows = {}
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        name = jax.tree_util.keystr(path)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {name} has shape {shape}; its leading (batch) dimension must be "
                f"divisible by the {n} data-parallel devices (the data-axis size, times "
                f"'replica' on a hybrid mesh). Use a batch size that is a multiple of {n}."
            )
        if shape[0] % (n * grad_accum):
            raise ValueError(
                f"batch leaf {name} has {shape[0]} rows, which do not split into {grad_accum} "
                f"micro-batches on each of {n} devices; use a batch size that is a multiple of "
                f"{n * grad_accum} or change grad_accum."
            )
        rows.setdefault(shape[0], name)
    if len(rows) > 1:
        found = ", ".join(f"{name}: {r}" for r, name in rows.items())
        raise ValueError(
            f"batch leaves have different leading (batch) dimensions ({found}); each device "
            "takes its slice of every leaf's rows, so all leaves need the same number of rows. "
            "Put per-step constants outside the batch (close over them in loss_fn)."
        )


def _short(treedef: Any, limit: int = 120) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_global_batch(batch: Any) -> None:
    """In a multi-process run, every batch leaf must be a global ``jax.Array``.

    A numpy (host) batch is ambiguous there -- the global batch on every process, or this
    process's rows? -- and taking it for the global batch trains on the wrong rows.
    """
    if jax.process_count() == 1:
        return
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not isinstance(x, jax.Array):
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} is a {type(x).__name__} in a run of "
                f"{jax.process_count()} processes, where a host array is ambiguous. Pass "
                "jzero.distributed.global_batch(mesh, local_rows) with this process's rows, "
                "or a global jax.Array (jax.make_array_from_process_local_data)."
            )


def check_same_on_every_process(tree: Any, what: str) -> None:
    """In a multi-process run, ``tree``'s host values are equal on every process.

    Compares per-leaf checksums (:mod:`.checksum`, computed on a local device) across
    processes; global arrays (spanning processes) are one value by construction.
    """
    if jax.process_count() == 1:
        return
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    local = [
        (path, x)
        for path, x in leaves
        if not (isinstance(x, jax.Array) and not x.is_fully_addressable)
    ]
    device = jax.local_devices()[0]
    sums = checksums(
        [jax.device_put(x, device) for _, x in local], [tuple(x.shape) for _, x in local]
    )
    mine = np.array([[int(h, 16) for h in s.split("-")] for s in sums], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [process, leaf, 2]
    for i, (path, _) in enumerate(local):
        differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p, i], every[0, i])]
        if differ:
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} differs between processes (process "
                f"{differ[0]} vs process 0): every process must pass the same values. Use "
                "init(init_fn=...) with the same key on every process (it builds the params "
                "inside jit, already sharded), or load the same file everywhere."
            )
