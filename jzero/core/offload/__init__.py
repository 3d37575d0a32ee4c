"""Optimizer offload (ZeRO-Offload), chosen by :class:`jzero.Offload` (``options``): the
state rests in pinned host memory and either the Optax update streams it through the
device (``update``; cut into a global part and one part per parameter leaf by ``split``,
big elementwise leaves in chunks by ``chunks``), or each leaf's update runs on the host
(``host_step``)."""
