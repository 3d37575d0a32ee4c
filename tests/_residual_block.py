"""The residual MLP block, ``x + down(tanh(up(x)))``, that the stage-3 gathering tests
stack ``L`` of as an NNX model: d_model ``D``, hidden ``H`` (the issue's 256 x 1024)."""

import jax.numpy as jnp
from flax import nnx

D, H = 256, 1024


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, H, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(H, D, use_bias=False, rngs=rngs)

    def __call__(self, x_BxD):
        return x_BxD + self.down(jnp.tanh(self.up(x_BxD)))
