"""Consolidated export: the whole model as one safetensors file, and back.

DeepSpeed's ``zero_to_fp32`` for jzero: :func:`export_safetensors` writes the parameters at
their true shapes (the fp32 master weights when the run keeps them) to one file that
PyTorch / Hugging Face / the ``safetensors`` library read without jzero;
:func:`load_safetensors` reads such a file back into a parameter tree, to start a run of
any stage on any mesh from it (``opt.init(load_safetensors(path, like=shapes))``).

Export streams: one small jitted program per distinct ``(Stored, dtype)`` gathers one leaf,
unpadded and replicated; it is copied to host, written and dropped before the next, so no
device and no host holds more than one gathered leaf beyond the state itself. The writer is
our own, :func:`write_safetensors`: the ``safetensors`` library has no streaming writer
(``safetensors.numpy.save_file`` and ``serialize_file`` take every tensor in memory at
once). It follows the format exactly (8-byte little-endian header length, compact JSON
header with ``dtype`` / ``shape`` / ``data_offsets`` and an optional ``__metadata__`` of
strings, padded with spaces to 8 bytes as the reference writer pads it, then the tensors'
little-endian bytes back to back), in the order given rather than the reference's
order by dtype, which readers do not depend on.

Only the parameters are exported; the optimizer state and ``model_state`` (e.g. Flax
``batch_stats``) are not. Reading BF16 tensors with ``safetensors``' numpy reader outside
jzero needs ``import ml_dtypes`` first (it fails with "data type 'bfloat16' not
understood" otherwise); PyTorch reads them natively.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axis_types import on_compute_mesh
from ..core.gpu_target.compile_only import check_runnable
from ..core.input_checks import check_live
from ..core.leaf_layout import unpad
from ..core.leaf_names import leaf_names
from ..core.plan import Stored, ZeroState
from ..optimizers.zero_optimizer import ZeroOptimizer
from .argument_checks import check_optimizer

_METADATA = "__metadata__"

_DTYPE_NAMES: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.complex64): "C64",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

Leaf = tuple[str, tuple[int, ...], Any, Callable[[], Any]]
"""``(name, shape, dtype, fetch)``: ``fetch()`` returns the leaf's array when it is written."""


def tensor_names(treedef_or_tree: Any) -> list[str]:
    """The tensor names of a file: :func:`leaf_names` of the parameters, which must not be a
    single bare array (it has no key path to name it by)."""
    names = leaf_names(treedef_or_tree)
    if names == [""]:
        raise ValueError(
            "the tree is a single leaf with no key path to name it by; wrap it in a dict, "
            'e.g. {"weight": x}.'
        )
    return names


def _dtype_name(dtype: Any, what: str) -> str:
    try:
        name = _DTYPE_NAMES.get(np.dtype(dtype))
    except TypeError:
        name = None
    if name is None:
        raise ValueError(
            f"{what} has dtype {dtype!r}, which safetensors cannot hold (it holds "
            f"{', '.join(sorted(n.lower() for n in _DTYPES))}); cast it to one of these, "
            "e.g. float32."
        )
    return name


def _check_path(path: str) -> None:
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path!r} is a directory; give the path of the file to write, e.g. "
            f"{os.path.join(path, 'model.safetensors')!r}."
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"the directory {parent!r} to write {os.path.basename(path)!r} into does not "
            "exist; create it first (os.makedirs(..., exist_ok=True))."
        )


def _header(leaves: Sequence[Leaf], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError(
                f"metadata must be a dict of str to str, got {metadata!r}; convert the "
                "values with str()."
            )
        header[_METADATA] = metadata
    offset = 0
    for name, shape, dtype, _ in leaves:
        if not isinstance(name, str) or not name or name == _METADATA:
            raise ValueError(f"tensor name {name!r} is empty, not a str, or reserved; rename it.")
        if name in header:
            raise ValueError(f"two tensors are named {name!r}; give each a distinct name.")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {shape}.")
        dtype_name = _dtype_name(dtype, f"tensor {name!r}")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": dtype_name,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _to_bytes(name: str, shape: tuple[int, ...], dtype: np.dtype, array: Any) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != shape or array.dtype != dtype:
        raise ValueError(
            f"tensor {name!r}: fetch() returned {array.dtype}{list(array.shape)}, but the "
            f"header says {dtype}{list(shape)}; make fetch return the declared shape and dtype."
        )
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def write_safetensors(
    path: str | os.PathLike, leaves: Sequence[Leaf], *, metadata: dict[str, str] | None = None
) -> None:
    """Writes a safetensors file one tensor at a time.

    The header is computed from the declared shapes and dtypes first; then each leaf's
    ``fetch()`` is called, in order, its bytes written and the array dropped, so at most one
    leaf's bytes are in host memory. The file is written to ``path + ".tmp"`` and renamed
    to ``path`` only when complete: a failure (or a crash) never leaves a partial file under
    ``path``, and an error removes the ``.tmp``.

    Args:
        path: the file to write (replaced if it exists).
        leaves: ``(name, shape, dtype, fetch)`` per tensor; ``fetch()`` returns an array
            (numpy, or anything ``np.asarray`` takes) of exactly that shape and dtype.
        metadata: optional ``__metadata__``: a dict of str to str.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        FileNotFoundError: ``path``'s directory does not exist.
        ValueError: duplicate or reserved names, a dtype safetensors cannot hold, or a
            ``fetch()`` result that differs from its declared shape or dtype.
    """
    path = os.fspath(path)
    _check_path(path)
    leaves = list(leaves)
    header = _header(leaves, metadata)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for name, shape, dtype, fetch in leaves:
                data = _to_bytes(name, tuple(int(s) for s in shape), np.dtype(dtype), fetch())
                f.write(data)
                del data  # before the next fetch(): one leaf on the host at a time
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@functools.lru_cache(maxsize=256)
def _gather_program(mesh: Any, stored: Stored, dtype: np.dtype) -> Callable[[jax.Array], Any]:
    def gather(x):
        x = unpad(x, stored.layout) if stored.partitioned else x
        return x.astype(dtype)

    return jax.jit(on_compute_mesh(gather, mesh), out_shardings=NamedSharding(mesh, P()))


def _export_dtype(dtype: Any) -> np.dtype | None:
    """``dtype=`` of :func:`export_safetensors`: None, or a floating dtype safetensors holds
    (a dtype, its name, or ``'bf16'`` / ``'fp16'`` / ``'fp32'``)."""
    from ..core.dtypes import float_dtype

    if dtype is None:
        return None
    floats = [d for d in _DTYPE_NAMES if jnp.issubdtype(d, jnp.floating)]
    example = "dtype=jnp.bfloat16, or None to keep the source's dtype (float32)"
    return float_dtype(dtype, what="export_safetensors(dtype=...)", allowed=floats, example=example)


def export_safetensors(
    opt: ZeroOptimizer, state: ZeroState, path: str | os.PathLike, *, dtype: Any = None
) -> list[str]:
    """Writes the whole model, at true shapes, to one safetensors file.

    The source is the fp32 master weights when the state keeps them (16-bit parameters),
    else the parameters. Leaf by leaf, a jitted program (one per distinct layout and dtype,
    cached) unpads the leaf, casts it and replicates it over the state's mesh; it is copied
    to host, written and dropped. Tensor names are :func:`leaf_names` of the parameters.

    Every process of a multi-process run must call this (each gather is a collective); only
    process 0 writes.

    Args:
        opt: the :class:`jzero.ZeroOptimizer` the state belongs to.
        state: its :class:`jzero.ZeroState`.
        path: the file to write, e.g. ``"model.safetensors"`` (replaced if it exists).
        dtype: cast floating leaves to this dtype (e.g. ``jnp.bfloat16``); None keeps the
            source's dtype (float32). Integer leaves keep theirs.

    Returns:
        The tensor names written, in file order.
    """
    check_optimizer(opt, "export_safetensors()")
    check_runnable(opt.mesh, "jzero.checkpoint.export_safetensors")
    check_live(state)  # before any buffer is read: a donated one can crash the process
    opt.check_state(state)
    dtype = _export_dtype(dtype)
    plan = state.plan
    source, stored = state.params, plan.params
    if plan.master is not None:
        source, stored = state.master, plan.master
    names = tensor_names(plan.params_def)
    arrays = jax.tree.leaves(source)

    def out_dtype(s: Stored) -> np.dtype:
        floating = jnp.issubdtype(s.dtype, jnp.floating)
        return dtype if dtype is not None and floating else np.dtype(s.dtype)

    def fetcher(i: int) -> Callable[[], Any]:
        return lambda: _gather_program(plan.mesh, stored[i], out_dtype(stored[i]))(arrays[i])

    leaves = [
        (name, s.layout.shape, out_dtype(s), fetcher(i))
        for i, (name, s) in enumerate(zip(names, stored))
    ]
    if jax.process_index() != 0:
        for *_, fetch in leaves:  # take part in every gather; process 0 writes
            fetch().block_until_ready()
        return names
    metadata = {
        "format": "jzero",
        "stage": str(plan.stage),
        "devices": str(plan.mesh.size),
        "dtype": (np.dtype(np.float32) if dtype is None else dtype).name,
        "source": "params" if plan.master is None else "master",
    }
    write_safetensors(path, leaves, metadata=metadata)
    return names


def _like_leaf(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = np.asarray(x)
    return tuple(int(s) for s in x.shape), np.dtype(x.dtype)


def load_safetensors(path: str | os.PathLike, like: Any = None) -> Any:
    """Reads a safetensors file (any writer's) into numpy arrays.

    Args:
        path: the file.
        like: optional parameter tree (arrays or ``jax.ShapeDtypeStruct`` s): the result
            then has its structure, and every leaf's name (:func:`leaf_names`), shape and
            dtype must match the file's.

    Returns:
        With ``like``: a tree shaped like it; without: a dict of name to array, in file
        order. ``opt.init(load_safetensors(path, like=shapes))`` starts a run from it.

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a directory (e.g. a checkpoint's).
        ValueError: the file is not safetensors (or is truncated); with ``like``, a leaf
            missing from the file or the file holding a tensor ``like`` lacks, or a shape or
            dtype differing; the error names the leaf.
    """
    path = os.fspath(path)
    with _open_safetensors(path) as f:
        if like is None:
            return {name: f.get_tensor(name) for name in f.offset_keys()}
        names, treedef = tensor_names(like), jax.tree.structure(like)
        found = set(f.keys())
        missing = [n for n in names if n not in found]
        extra = sorted(found - set(names))
        if missing or extra:
            raise ValueError(
                f"{path!r} does not hold the tree of `like`: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{' ...' if len(extra) > 5 else ''}; pass the parameter tree the file was "
                "exported from (its names are leaf_names(like)), or like=None for a flat dict."
            )
        out = []
        for name, x in zip(names, jax.tree.leaves(like)):
            shape, dtype = _like_leaf(x)
            view = f.get_slice(name)
            got_shape, got_dtype = tuple(view.get_shape()), _DTYPES.get(view.get_dtype())
            if got_shape != shape or got_dtype != dtype:
                got = f"{got_dtype or view.get_dtype()}{list(got_shape)}"
                raise ValueError(
                    f"leaf {name!r}: the file holds {got}, `like` expects "
                    f"{dtype}{list(shape)}; pass a `like` with the file's shapes and dtypes "
                    "(or export with dtype= matching the model)."
                )
            out.append(f.get_tensor(name))
    return jax.tree.unflatten(treedef, out)


def _open_safetensors(path: str) -> Any:
    """``safe_open(path)``, with errors that say what the file is not and what to pass."""
    from safetensors import SafetensorError, safe_open  # optional: only the reader needs it

    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path!r} is a directory, not a safetensors file. A jzero checkpoint directory "
            "is restored with jzero.Checkpointer(path).restore(opt, like), or converted with "
            "`python -m jzero checkpoint export DIR OUT.safetensors`."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file at {path!r}.")
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise ValueError(
            f"{path!r} is not a safetensors file, or is truncated ({e}); pass a file written "
            "by jzero.checkpoint.export_safetensors or safetensors' save_file."
        ) from None
