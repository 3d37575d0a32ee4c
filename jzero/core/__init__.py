"""The core: the mesh, where every leaf lives, the training step and the optimizer.

Dependencies point one way: ``mesh`` <- ``leaf_layout`` (one leaf's shard dimension and
padding) <- ``plan`` (every leaf's layout, stage, dtype and memory kind) <- ``zero_state``
(the state pytree) <- ``stored_form`` (states between their true shapes and their stored,
padded shards) <- ``train_step`` (``local_grads``: forward/backward per device under
``shard_map``, ``grad_reduction``; then the global-view update) <- ``optimizer``. Options
travel as objects: ``precision.Precision`` (dtypes, loss scaling), ``communication.
Communication`` (quantized collectives, buckets, prefetch), ``offload.options.Offload`` and
``step_options.StepOptions`` (how the loss is called). Three subpackages serve the step:
``comm`` (the collectives, bucketed and quantized), ``gather`` (where stage 3 gathers: per
layer, prefetched, rematerialised; on ``comm``) and ``offload`` (the optimizer state in
host memory, streamed through the device or updated on the host). Checks live beside what
they check: ``checks`` (inputs and states), ``loss_protocol`` (what ``loss_fn`` returns),
``memory_kinds`` (leaves in the memory their plan says), ``axis_aliases`` (the model's
names for the batch axis). Nothing here imports the optimizer, the Flax adapters or the
accounting.
"""
