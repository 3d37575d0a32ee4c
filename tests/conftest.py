"""Test setup: 8 forced CPU devices, before any device is touched.

Strict dtype promotion (as equinox's tests use) is not switched on: Optax itself raises
under it (e.g. Adam's bias correction computes ``float ** int32``), and the oracle here is
unmodified Optax.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
