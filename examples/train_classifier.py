"""Train a small Flax NNX classifier with BatchNorm on 2-D spirals with jzero (ZeRO 0-3).

    python examples/train_classifier.py                 # stage 3 on 8 forced CPU devices
    python examples/train_classifier.py --stage 1 --steps 300
    bash scripts/launch_local.sh 2 python examples/train_classifier.py   # 2 processes x 4

The data (``--classes`` interleaved spiral arms with noise) is generated here. The model
is an MLP whose hidden blocks (Linear -> BatchNorm -> ReLU) are stacked with ``nnx.vmap``
and applied with ``nnx.scan``. ``jzero.nnx.TrainState`` partitions the ``nnx.Param``
state over the devices and carries the BatchNorm statistics, identical on every device.
Under ``scripts/launch_local.sh N`` every process generates the same data and places only
its own rows of each batch; process 0 alone prints.
Tensor names carry their shapes (B batch, H hidden width, C classes).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from devices import global_batch, setup_devices
from flax import nnx
from progress import trend

import jzero


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="global; a multiple of devices")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3, help="hidden blocks, scanned")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=8, help="CPU devices forced without GPU")
    return p.parse_args(argv)


def spirals(n: int, classes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points on ``classes`` interleaved spiral arms: x float32[n, 2], y int32[n]."""
    y_B = rng.integers(0, classes, n).astype(np.int32)
    r_B = rng.uniform(0.1, 1.0, n)
    theta_B = 2 * np.pi * y_B / classes + 3.0 * r_B + rng.normal(0, 0.15, n)
    x_Bx2 = np.stack([r_B * np.cos(theta_B), r_B * np.sin(theta_B)], axis=1)
    return x_Bx2.astype(np.float32), y_B


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, use_bias=False, rngs=rngs)  # BatchNorm has the bias
        self.bn = nnx.BatchNorm(width, rngs=rngs)

    def __call__(self, x_BxH: jax.Array) -> jax.Array:
        return jax.nn.relu(self.bn(self.linear(x_BxH)))


class Classifier(nnx.Module):
    def __init__(self, hidden: int, layers: int, classes: int, rngs: nnx.Rngs):
        self.inp = nnx.Linear(2, hidden, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(hidden, rngs)

        self.blocks = make_blocks(rngs)  # every Param has a leading [layers] axis
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x_Bx2: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block: Block, x_BxH: jax.Array) -> jax.Array:
            return block(x_BxH)

        return self.out(body(self.blocks, jax.nn.relu(self.inp(x_Bx2))))


def loss_fn(model: Classifier, batch: dict[str, jax.Array]) -> jax.Array:
    logits_BxC = model(batch["x"])  # BatchNorm in training mode: updates its statistics
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, batch["y"]).mean()


def accuracy(model: Classifier, x_Bx2: np.ndarray, y_B: np.ndarray) -> float:
    model.eval()  # BatchNorm uses its running statistics
    return float(jnp.mean(jnp.argmax(model(x_Bx2), axis=-1) == y_B))


def echo(*args, **kwargs) -> None:
    """``print`` on process 0; nothing on the others of a multi-process run."""
    if jzero.distributed.is_main_process():
        print(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = setup_devices(args.cpu_devices)
    rng = np.random.default_rng(args.seed)
    x_test, y_test = spirals(2048, args.classes, rng)

    model = Classifier(args.hidden, args.layers, args.classes, nnx.Rngs(args.seed))
    mesh = jzero.data_mesh(devices)
    state = jzero.nnx.TrainState.create(model, tx=optax.adam(args.lr), mesh=mesh, stage=args.stage)
    del model  # the state holds the parameters now, partitioned per stage
    train_step = state.train_step(loss_fn)
    echo(f"devices: {len(devices)} x {devices[0].platform}; ZeRO stage {args.stage}")
    echo(state.zero.plan.describe())  # every Param leaf: shard dim, stored shape, spec

    losses = []
    for step in range(args.steps):
        x_Bx2, y_B = spirals(args.batch_size, args.classes, rng)
        # The same global batch on every process, each placing its own rows.
        state, metrics = train_step(state, global_batch(mesh, {"x": x_Bx2, "y": y_B}))
        losses.append(float(metrics["loss"]))
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            echo(f"step {step:4d}  loss {losses[-1]:.4f}")

    acc = accuracy(state.model(), x_test, y_test)
    echo(f"{trend('loss', losses[0], losses[-1])}, test accuracy {acc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
