"""What the offload tests share: the host memory kind, the Optax transformations they run
(elementwise, clipped, factored, and one whose update does not split per leaf), and the
memory kinds a tree's leaves rest in."""

import jax
import optax

HOST = "pinned_host"
TXS = {
    "adam": optax.adam(1e-2),
    "clip_adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "adafactor": optax.adafactor(1e-2),
    # Clips Adam's *updates*: the norm reads every leaf's moments, so no per-leaf split.
    "adam_clip": optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.5)),
}


def memory_kinds(tree) -> set[str]:
    """The memory kinds of ``tree``'s (array) leaves."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
