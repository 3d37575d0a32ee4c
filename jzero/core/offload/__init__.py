"""Optimizer offload (ZeRO-Offload): the state rests in pinned host memory and the Optax
update streams it through the device (``update``), cut into a global part and one part
per parameter leaf (``split``), big elementwise leaves in chunks (``chunks``)."""
