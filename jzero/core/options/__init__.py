"""A run's configuration: :class:`.zero_config.ZeroConfig` and the option classes it
composes (``layout``, ``precision``, ``communication``, ``offload``, ``step``), each
checked when it is built."""
