"""The core: mesh, plan and layout, collectives, placement, precision, the step, remat.

Dependencies point one way: ``mesh`` <- ``layout`` <- ``plan`` <- ``state`` <- ``placement``
<- ``step`` <- ``optimizer``; ``collectives``, ``precision`` and ``checks`` are used by the
step and the optimizer; ``remat`` sits on ``collectives``. Nothing here imports the
optimizer, the Flax adapters or the accounting.
"""
