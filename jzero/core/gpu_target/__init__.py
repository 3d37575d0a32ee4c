"""Compiling for GPUs that are not here: :func:`jzero.gpu_mesh`'s compile-only meshes
(``topology``: XLA's GPU specs in ``specs/``, the CUDA plugin's checks), how a cluster of
GPUs is spelled (``cluster``) and the refusals of what would run on them
(``compile_only``)."""

from .cluster import gpu_names as gpu_names
from .compile_only import check_runnable as check_runnable
from .compile_only import is_compile_only as is_compile_only
from .topology import gpu_mesh as gpu_mesh
