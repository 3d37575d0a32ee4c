"""How far rounding-sized noise moves a training run: is comparing two runs' losses sound?

Two programs that compute the same thing but round differently (another summation
order, another CPU) may be compared step by step only while the run does not amplify
rounding. This trains the example LM (``examples/gpt.py`` on ``examples/data.py``'s
training split) on one device with plain Optax, once exactly and once per seed with
Gaussian noise of ``2^-bits`` times each gradient leaf's RMS added to every gradient
element at every step (fp32 rounds at 2^-24 relative), and prints each noisy run's
largest relative loss difference from the exact run, and at which step.

    # tests/project/test_train_lm.py's runs (examples/train_lm.py's clipped AdamW, warmup + cosine)
    python scripts/sensitivity.py --steps 20 --batch 8 --schedule cosine --clip 1.0 --bits 20
    # tests/_lm.py's (constant-lr AdamW, 200 steps): chaotic
    python scripts/sensitivity.py --steps 200 --batch 16 --schedule constant --bits 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import data  # noqa: E402  (examples/data.py)
import gpt  # noqa: E402  (examples/gpt.py)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2, help="(peak) AdamW learning rate")
    ap.add_argument(
        "--schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="cosine: examples/train_lm.py's warmup (steps/10) and cosine decay",
    )
    ap.add_argument("--clip", type=float, help="clip_by_global_norm first (train_lm: 1.0)")
    ap.add_argument("--bits", type=float, default=20, help="noise: 2^-bits x each leaf's RMS")
    ap.add_argument("--seeds", type=int, default=8, help="noisy runs")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    return ap.parse_args(argv)


def make_tx(args: argparse.Namespace) -> optax.GradientTransformation:
    lr = args.lr
    if args.schedule == "cosine":
        warmup = max(1, args.steps // 10)
        lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, decay_steps=args.steps)
    adamw = optax.adamw(lr, weight_decay=0.1)
    return adamw if args.clip is None else optax.chain(optax.clip_by_global_norm(args.clip), adamw)


def make_step(cfg: gpt.GPTConfig, tx: optax.GradientTransformation):
    loss_fn = gpt.make_loss_fn(cfg)

    @jax.jit
    def step(params, opt_state, batch, key, scale):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        leaves, treedef = jax.tree.flatten(grads)
        keys = jax.random.split(key, len(leaves))
        noisy = [
            g + scale * jnp.sqrt(jnp.mean(g**2)) * jax.random.normal(k, g.shape)
            for g, k in zip(leaves, keys)
        ]
        updates, opt_state = tx.update(treedef.unflatten(noisy), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def losses(args, cfg, step, tx, seed: int, scale: float) -> np.ndarray:
    train, _ = data.split(data.load_corpus(), 0.1)
    batches = data.batches(train, batch_size=args.batch, seq_len=cfg.seq_len, seed=0)
    params = gpt.init_params(cfg, jax.random.key(0))
    opt_state, out = tx.init(params), []
    for i in range(args.steps):
        key = jax.random.fold_in(jax.random.key(seed), i)
        params, opt_state, loss = step(params, opt_state, next(batches), key, scale)
        out.append(float(loss))
    return np.array(out)


def main(argv: list[str] | None = None) -> list[float]:
    """Each noisy run's largest relative loss difference from the exact run."""
    args = parse_args(argv)
    cfg = gpt.GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers
    )
    tx = make_tx(args)
    step = make_step(cfg, tx)
    exact = losses(args, cfg, step, tx, 0, 0.0)
    print(f"exact: loss {exact[0]:.4f} -> {exact[-1]:.4f} in {args.steps} steps")
    worst = []
    for seed in range(1, args.seeds + 1):
        rel = np.abs(losses(args, cfg, step, tx, seed, 2.0**-args.bits) - exact) / exact
        worst.append(float(rel.max()))
        print(f"noise 2^-{args.bits:g}, seed {seed}: largest relative loss difference "
              f"{rel.max():.2e} (step {int(rel.argmax()) + 1}), last {rel[-1]:.2e}")  # fmt: skip
    print(f"largest over {args.seeds} seeds: {max(worst):.2e}")
    return worst


if __name__ == "__main__":
    main()
