"""Device set-up shared by the examples (the library itself never touches jax.config)."""

import jax


def setup_devices(cpu_devices: int) -> list[jax.Device]:
    """All accelerators, or ``cpu_devices`` forced CPU devices when there are none.

    ``jax_num_cpu_devices`` only shapes the CPU backend, so setting it is harmless on GPU/TPU,
    where ``jax.devices()`` returns the accelerators. It must happen before any JAX operation.
    """
    if jax.config.jax_num_cpu_devices != cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    return jax.devices()
