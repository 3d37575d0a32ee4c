"""jzero inside the user's own ``jax.jit`` step: an Optax transformation whose state,
gradients and (at stage 3) parameters are laid out along ``data`` in their true shapes,
so that the compiler places ZeRO's collectives (:func:`.transformation.shard_optimizer`,
:func:`.placement.shard_params`, :mod:`.layout`)."""
