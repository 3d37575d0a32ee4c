"""Test setup: 8 forced CPU devices, before any device is touched.

Strict dtype promotion (as equinox's tests use) is not switched on: Optax itself raises
under it (e.g. Adam's bias correction computes ``float ** int32``), and the oracle here is
unmodified Optax.
"""

import os

# The CPU alone, in this process and in the processes tests start: with JAX's CUDA plugin
# installed (the gpu-compile extra, for jzero.gpu_mesh) and no GPU, JAX would otherwise try
# the plugin first. It still describes GPUs to compile for.
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
