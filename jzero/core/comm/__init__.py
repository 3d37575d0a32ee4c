"""How a sharded leaf travels, inside ``jax.shard_map`` over ``data``: the per-leaf
all-gather / reduce-scatter and the :class:`Sharded` handle (``collectives``), many
leaves in one flat message (``buckets``), and their int8/int4 forms with blockwise scales
(``quantize``, ZeRO++'s qwZ and qgZ)."""
