"""The Flax adapters: ``jzero.linen`` (Linen modules) and ``jzero.nnx`` (NNX modules)."""
