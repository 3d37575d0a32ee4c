"""The core: the configuration, the mesh, where every leaf lives, and the step.

Dependencies point one way: ``options`` (the run's one :class:`ZeroConfig` and the option
classes it composes) <- ``plan`` (every leaf's layout, dtype and memory kind, referring to
the config; the :class:`ZeroState` it lays out) <- ``stored_form`` (states between their
true shapes and their stored, padded shards) <- ``train_step``; ``planning`` makes the plan
of a parameter tree for the optimizers above the core (:mod:`jzero.optimizers`). The step
composes three strategies built once from the config: the gatherer and the reducer
(``comm``: the collectives, bucketed and quantized; ``gather``: where stage 3 gathers, per
layer, prefetched, rematerialised) used by ``local_grads`` (forward/backward per device
under ``shard_map``), and the updater (``updaters``: on the device, or with the state in
host memory, ``offload``). Checks live beside what they check: ``input_checks`` (inputs
and states), ``loss_protocol`` (what ``loss_fn`` returns), ``memory_kinds`` (leaves in the
memory their plan says), ``axis_aliases`` (the model's names for the batch axis). Nothing
here imports the optimizers, the Flax adapters, the checkpointer or the accounting
(jzero/README.md).
"""
