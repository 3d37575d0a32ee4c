"""The core: mesh, plan and layout, placement, precision, checks, the step, the optimizer.

Dependencies point one way: ``mesh`` <- ``layout`` <- ``plan`` <- ``state`` <- ``placement``
<- ``step`` <- ``optimizer``. Three subpackages serve the step: ``comm`` (the collectives,
bucketed and quantized), ``gather`` (where stage 3 gathers: per layer, prefetched,
rematerialised; on ``comm``) and ``offload`` (the optimizer state streamed from host
memory). Nothing here imports the optimizer, the Flax adapters or the accounting.
"""
