"""What users hold: :class:`jzero.ZeroOptimizer` (jzero's own step, whose collectives it
writes under ``shard_map``) and, for the user's own ``jax.jit`` step,
:func:`jzero.shard_optimizer` and :func:`jzero.shard_params` (``user_step``: the compiler
places ZeRO's collectives). Both ask the core for the plan of a parameter tree
(:func:`jzero.core.planning.plan_for`); nothing in the core imports them."""
