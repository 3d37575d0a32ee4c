"""Test setup: 8 forced CPU devices and strict dtype promotion, before any device is touched."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_platforms", "cpu")
