"""Train a small GPT on the King James Bible with jzero (ZeRO stage 0-3), then sample from it.

    python examples/train_lm.py                 # stage 3 on 8 forced CPU devices, ~5 min
    python examples/train_lm.py --stage 1 --steps 100 --out runs/zero1
    python examples/train_lm.py --verbose       # + the layout and per-collective report
    python examples/train_lm.py --checkpoint-dir runs/ckpt --save-every 100
    python examples/train_lm.py --checkpoint-dir runs/ckpt --resume     # after an interruption
    bash scripts/launch_local.sh 2 python examples/train_lm.py            # 2 processes x 4 CPUs
    python examples/train_lm.py --offload host --grad-quant int8   # ZeRO-Offload + ZeRO++ qgZ
    python examples/train_lm.py --deepspeed-config examples/deepspeed/zero2_fp16.json

Without a GPU/TPU the script forces ``--cpu-devices`` CPU devices (default 8) so that the
data axis is real; on GPUs it uses all of them. The text is the complete King James Bible
(4.3 MB, ``examples/data/``); whole chapters, a ``--val-fraction`` share of them spread
evenly through it, are held out of training, and ``--val-windows`` fixed windows of them
are scored every ``--eval-every`` steps. It prints a short summary: the run, a few points
of the training and validation curves, tokens/s, a text sample and the longest span the
sample shares with the training text (``--verbose`` adds the per-leaf layout and
``jzero.report``'s per-collective table). Writes OUT/train.log (one line per step and per
evaluation), OUT/loss.png (both curves) and OUT/summary.json (the figures, for tools).
Tensor names carry their shapes (B batch, T time, V vocab, N validation windows).

With ``--checkpoint-dir`` it saves a :class:`jzero.Checkpointer` checkpoint every
``--save-every`` steps and after the last; ``--resume`` continues from the newest valid one
(at any stage or device count) exactly where it was: step, data position and loss curve.

``--offload`` keeps the sharded optimizer state and fp32 master weights in pinned host
memory, streamed through the device for the update (``Offload(optimizer="stream")``, also
``--offload stream``); ``--offload host`` runs the update on the host instead (ZeRO-Offload's
split, ``Offload(optimizer="host")``); ``--offload-params`` keeps stage 3's parameter shards
there too (ZeRO-Infinity's parameter offload, ``Offload(params=True)``). ``--grad-quant
int8|int4`` reduce-scatters the gradients quantized (``Communication(grad_quant=...)``,
ZeRO++ qgZ). The offloads and ``--grad-quant`` need stage 1-3 (``--offload-params``: 3).

With ``--deepspeed-config PATH`` a DeepSpeed JSON config (``jzero.from_deepspeed_config``)
sets the stage, the precision (gradient quantization included), the offload, the optimizer
with its schedule and clipping, and the batch size and micro-batches when it has them; a
flag for one of those given as well is refused.

Under ``scripts/launch_local.sh N`` (or any launcher that sets ``JZERO_NUM_PROCESSES``)
every process runs this script; ``devices.setup_devices`` joins them into one run over
every process's devices (``--timeout`` bounds a lost peer). Each process draws the same
global batches and validation windows and places only its own rows, so the run computes
what one process over the same devices does; process 0 alone prints, logs and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from devices import bounded, global_batch, setup_devices, sync_processes
from tqdm import tqdm

import jzero
from jzero.cli.units import parse_bytes

sys.path.insert(0, str(Path(__file__).parent))
import data  # noqa: E402
import gpt  # noqa: E402
import progress  # noqa: E402
import run_summary  # noqa: E402
from progress import Clock  # noqa: E402
from run_summary import json_float  # noqa: E402

PRECISIONS = {
    "fp32": jzero.Precision(),
    "bf16": jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
    "fp16": jzero.Precision(param_dtype=jnp.float16, reduce_dtype=jnp.float32),
}
SAVE_EVERY = 100  # --save-every's default
KEEP = 3  # checkpoints kept in --checkpoint-dir (older ones are deleted)
# Flags an uninterrupted run depends on beyond the model's shapes (which the checkpoint
# checks itself): the data order and the learning-rate schedule.
RUN_FLAGS = ("seed", "batch_size", "seq_len", "val_fraction", "val_windows", "steps", "lr")
# Flags that --deepspeed-config may set, with the config keys that set them.
DEEPSPEED_FLAGS = {
    "stage": "zero_optimization.stage",
    "precision": '"fp16" / "bf16"',
    "offload": "zero_optimization.offload_optimizer",
    "offload_params": "zero_optimization.offload_param",
    "grad_quant": "zero_optimization.zero_quantized_gradients",
    "lr": '"optimizer" / "scheduler"',
    "batch_size": "train_batch_size / train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def stage_arg(text: str) -> int | str:
    """``--stage``: 0-3, or ``auto`` (:func:`jzero.autoconfigure` chooses the configuration)."""
    if text == "auto":
        return text
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0, 1, 2, 3 or auto")
    return int(text)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--stage",
        type=stage_arg,
        default=3,
        help="ZeRO stage 0-3, or auto: the stage, offload and micro-batches that fit "
        "--device-budget (and --host-budget) with the lowest predicted step time",
    )
    p.add_argument(
        "--device-budget",
        type=parse_bytes,
        help="with --stage auto: device memory per device (default: the device's)",
    )
    p.add_argument(
        "--host-budget",
        type=parse_bytes,
        help="with --stage auto: pinned host memory per device, to consider offload",
    )
    p.add_argument("--steps", type=positive_int, default=700)
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="global; a multiple of devices x K"
    )
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (AdamW)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: Newton-Schulz on the blocks' weight matrices at --muon-lr, AdamW at --lr "
        "on the embeddings and the rest (gpt.muon), each matrix updated whole by jzero",
    )
    p.add_argument("--muon-lr", type=float, default=0.02, help="peak learning rate (Muon)")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp32",
        help="bf16/fp16: 16-bit params and compute, fp32 master weights and gradient "
        "reduction; fp16 adds dynamic loss scaling",
    )
    p.add_argument("--grad-accum", type=positive_int, default=1, help="K micro-batches per step")
    p.add_argument(
        "--offload",
        nargs="?",
        const="stream",
        choices=["stream", "host"],
        help="keep the sharded optimizer state and fp32 master weights in pinned host memory "
        "(stages 1-3): stream (the default) copies them through the device for the update, "
        "host runs the update on the host (ZeRO-Offload)",
    )
    p.add_argument(
        "--offload-params",
        action="store_true",
        help="keep stage 3's parameter shards in pinned host memory too, copied in at each "
        "gather (ZeRO-Infinity's parameter offload; stage 3)",
    )
    p.add_argument(
        "--grad-quant",
        choices=["int8", "int4"],
        default=None,
        help="reduce-scatter the gradients quantized, with one fp32 scale per block (ZeRO++ "
        "qgZ; stages 1-3)",
    )
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of the chapters held out of training, whole, spread evenly (0.1: every 10th)",
    )
    p.add_argument(
        "--val-windows",
        type=positive_int,
        default=128,
        help="fixed windows of --seq-len bytes, spread evenly over the held-out chapters, "
        "that every evaluation scores",
    )
    p.add_argument("--eval-every", type=positive_int, default=50, help="steps between evals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/train_lm"))
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--prompt", default="And God said")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print the per-leaf layout and jzero.report's per-collective table",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="CPU devices forced without GPU (multi-process: $JZERO_LOCAL_CPU_DEVICES each)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="multi-process only: seconds for the processes to start and for a lost peer to "
        "end the run (a training step, with its evaluation, must take less than 0.9x this)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help=f"save checkpoints here (the {KEEP} newest are kept)",
    )
    p.add_argument(
        "--save-every",
        type=positive_int,
        default=None,
        help=f"steps between checkpoints (default {SAVE_EVERY}); the last step is always saved",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --checkpoint-dir (keep --steps: "
        "the total, which also sets the learning-rate schedule)",
    )
    p.add_argument(
        "--deepspeed-config",
        type=Path,
        default=None,
        help="a DeepSpeed JSON config (e.g. examples/deepspeed/zero2_fp16.json); it replaces "
        "--stage, --precision, --offload, --offload-params, --grad-quant, --lr (with its "
        "optimizer/scheduler), "
        "--batch-size and --grad-accum (with its batch sizes)",
    )
    return p


def apply_deepspeed_config(parser, args, argv, n_devices: int):
    """Reads ``--deepspeed-config`` into ``args`` (stage, precision name, offload, gradient
    quantization, batch size, grad accum) and returns its
    :class:`jzero.config.DeepSpeedOptions`. Refuses a flag that the config sets too, and a
    config whose batch sizes do not fit ``n_devices``."""
    path = args.deepspeed_config
    try:
        ds = jzero.from_deepspeed_config(path)
        has_batch = ds.train_batch_size is not None or ds.micro_batch_size is not None
        batch = ds.batch_sizes(data_parallel_size=n_devices) if has_batch else None
    except (OSError, ValueError) as e:
        parser.error(f"--deepspeed-config {path}: {e}")
    sets = {"stage", "precision", "offload", "offload_params", "grad_quant"}
    sets |= {"lr"} if ds.learning_rate is not None else set()
    sets |= {"batch_size", "grad_accum"} if has_batch else set()
    sets |= {"grad_accum"} if ds.grad_accum is not None else set()
    probe, unset = make_parser(), object()
    probe.set_defaults(**dict.fromkeys(DEEPSPEED_FLAGS, unset))
    given = vars(probe.parse_args(argv))
    for name in sorted(n for n in sets if given[n] is not unset):
        flag = f"--{name.replace('_', '-')}"
        parser.error(
            f"{flag} and --deepspeed-config both set it ({DEEPSPEED_FLAGS[name]} in {path}); "
            f"drop {flag} or edit the config"
        )
    args.stage = ds.stage
    args.offload = ds.offload.optimizer if ds.offload is not None else None
    args.offload_params = ds.offload is not None and ds.offload.params
    args.grad_quant = ds.comm.grad_quant
    args.precision = {"float16": "fp16", "bfloat16": "bf16"}.get(
        ds.precision.param_dtype.name, "fp32"
    )
    if batch is not None:
        args.batch_size, args.grad_accum = batch.train_batch_size, batch.grad_accum
    elif ds.grad_accum is not None:
        args.grad_accum = ds.grad_accum
    return ds


def run_precision(args, ds=None) -> jzero.Precision:
    """``--precision``, or the DeepSpeed config's precision."""
    return ds.precision if ds is not None else PRECISIONS[args.precision]


def check_auto(parser, args, argv) -> None:
    """``--stage auto`` chooses the offload and the micro-batches: flags that set them are
    refused (a DeepSpeed config sets the stage itself)."""
    if args.deepspeed_config is not None:
        parser.error("--stage auto and --deepspeed-config: the config sets the stage; drop one")
    chosen = {"--offload": args.offload, "--offload-params": args.offload_params}
    chosen["--grad-accum"] = any(a.startswith("--grad-accum") for a in argv or sys.argv[1:])
    for flag, given in chosen.items():
        if given:
            parser.error(f"--stage auto chooses {flag[2:]} itself; drop {flag}")


def choose_config(args, parser, cfg, mesh, init_fn, log) -> jzero.ZeroConfig:
    """``--stage auto``: :func:`jzero.autoconfigure` on this run's model, batch and
    precision; its table is printed, and the flags become its choice."""
    tx, _ = make_tx(args, cfg)
    base = jzero.ZeroConfig(
        stage=3,  # the run's own options only; the search sets the stage
        precision=run_precision(args),
        comm=jzero.Communication(grad_quant=args.grad_quant),
        step=jzero.StepOptions(manual_gather=True),
    )
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, cfg.seq_len + 1), jnp.int32)}
    stages = (1, 2, 3) if args.grad_quant is not None else (0, 1, 2, 3)
    choice = jzero.autoconfigure(
        gpt.make_loss_fn(cfg), init_fn=init_fn, batch=batch, mesh=mesh, tx=tx, config=base,
        device_budget=args.device_budget, host_budget=args.host_budget, stages=stages,
    )  # fmt: skip
    for line in [*choice.table().splitlines(), choice.summary()]:
        say(log, line)
    if choice.config is None:
        parser.error(f"--stage auto: {choice.summary()}")
    config = choice.config
    args.stage, args.grad_accum = config.stage, config.step.grad_accum
    args.offload = config.offload.optimizer
    return config


def make_tx(args, cfg=None):
    """AdamW (or ``--optimizer muon``: Muon on the blocks' matrices of the model ``cfg``)
    with warmup and cosine decay from the flags, clipped; and AdamW's schedule."""
    warmup_cosine = lambda peak: optax.warmup_cosine_decay_schedule(
        0.0, peak, warmup_steps=max(1, args.steps // 10), decay_steps=args.steps
    )
    schedule = warmup_cosine(args.lr)
    if getattr(args, "optimizer", "adamw") == "muon":
        shapes = jax.eval_shape(functools.partial(gpt.init_params, cfg, jax.random.key(0)))
        inner = gpt.muon(
            shapes,
            warmup_cosine(args.muon_lr),
            adam_learning_rate=schedule,
            weight_decay=0.1,
        )
    else:
        inner = optax.adamw(schedule, weight_decay=0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), inner), schedule


def make_optimizer(args, mesh, ds=None, config=None, cfg=None):
    """The run's :class:`jzero.ZeroOptimizer` and learning-rate schedule: AdamW (or Muon)
    with warmup and cosine decay from the flags, or the DeepSpeed config's optimizer (else
    AdamW on its schedule) with its clipping, stage, precision and offload."""
    tx, schedule = make_tx(args, cfg)
    if ds is None:
        config = run_config(args) if config is None else config
        return jzero.ZeroOptimizer(tx, mesh, config=config), schedule
    if ds.learning_rate is not None:
        lr = ds.learning_rate
        schedule = lr if callable(lr) else optax.constant_schedule(lr)
    own = None if ds.tx is not None else optax.adamw(schedule, weight_decay=0.1)
    return ds.optimizer(mesh, tx=own), schedule


def run_config(args) -> jzero.ZeroConfig:
    """The run's :class:`jzero.ZeroConfig` from the flags (``--stage``, ``--precision``,
    ``--grad-quant``, ``--offload``, ``--offload-params``, ``--grad-accum``; every step
    of the main job gathers by hand, per layer)."""
    offload = None
    if args.offload or args.offload_params:
        offload = jzero.Offload(optimizer=args.offload, params=args.offload_params)
    return jzero.ZeroConfig(
        stage=args.stage,
        precision=run_precision(args),
        comm=jzero.Communication(grad_quant=args.grad_quant),
        offload=offload,
        step=jzero.StepOptions(manual_gather=True, grad_accum=args.grad_accum),
    )


def make_logger(out: Path) -> logging.Logger:
    """OUT/train.log's logger on process 0; on the others one that writes nothing."""
    log = logging.getLogger(f"train_lm.{out.resolve()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not jzero.distributed.is_main_process():
        log.addHandler(logging.NullHandler())
        return log
    handler = logging.FileHandler(out / "train.log", mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    return log


def tree_bytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def layout_summary(state: jzero.ZeroState) -> str:
    plan = state.plan
    p_sharded = sum(lay.sharded for lay in plan.layouts)
    o_sharded = sum(lay.sharded for lay in plan.opt_layouts)
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    where = " in pinned host memory" if plan.config.offload.optimizer is not None else ""
    params_where = " in pinned host memory" if plan.offloads_params else ""
    return (
        f"stage {plan.stage} on {plan.data_size} devices: "
        f"params {p_sharded}/{len(plan.layouts)} leaves sharded, "
        f"{mib(tree_bytes_per_device(state.params))} per device{params_where}; "
        f"optimizer state {o_sharded}/{len(plan.opt_layouts)} leaves sharded, "
        f"{mib(tree_bytes_per_device(state.opt_state))} per device{where}"
    )


def make_eval_loss(cfg: gpt.GPTConfig):
    """Jitted ``eval_loss(params, windows) -> float32[]``: mean next-byte cross-entropy over
    the real windows of :func:`data.eval_windows` (padding has weight 0). ``params`` are full
    arrays (``opt.full_params``); windows sharded over 'data' split the work over devices."""

    @jax.jit
    def eval_loss(params, windows):
        tokens_NxTp1, weight_N = windows["tokens"], windows["weight"]
        logits_NxTxV = gpt.logits_fn(cfg, params, tokens_NxTp1[:, :-1]).astype(jnp.float32)
        losses_NxT = optax.softmax_cross_entropy_with_integer_labels(
            logits_NxTxV, tokens_NxTp1[:, 1:]
        )
        return jnp.sum(losses_NxT.mean(axis=1) * weight_N) / jnp.sum(weight_N)

    return eval_loss


def echo(*args, **kwargs) -> None:
    """``print`` on process 0; nothing on the others of a multi-process run."""
    if jzero.distributed.is_main_process():
        print(*args, **kwargs)


def sample(cfg, params, prompt: str, n_tokens: int, temperature: float, seed: int) -> np.ndarray:
    """Autoregressive sampling on one of this process's devices, over a sliding window of
    ``cfg.seq_len``: the prompt's bytes and ``n_tokens`` more, ``uint8[...]``. ``params``:
    full arrays (``opt.full_params``, replicated everywhere)."""
    params = jax.device_put(jax.tree.map(np.asarray, params), jax.local_devices()[0])

    @jax.jit
    def next_token(params, window_1xT, pos, key):
        logits_V = gpt.logits_fn(cfg, params, window_1xT)[0, pos].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits_V).astype(jnp.int32)
        return jax.random.categorical(key, logits_V / temperature).astype(jnp.int32)

    tokens = list(np.frombuffer(prompt.encode(), dtype=np.uint8)) or [ord("\n")]
    key = jax.random.key(seed)
    for _ in range(n_tokens):
        context = tokens[-cfg.seq_len :]
        window_1xT = np.zeros((1, cfg.seq_len), np.int32)  # causal: the padding after is unseen
        window_1xT[0, : len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, window_1xT, len(context) - 1, sub)))
    return np.array(tokens, dtype=np.uint8)


@dataclasses.dataclass
class Curve:
    """The run so far, per step and per evaluation. Every checkpoint holds it (with the data
    position) in its ``extra``, so a resumed run logs and plots the whole run."""

    losses: list[float] = dataclasses.field(default_factory=list)  # step i: after i updates
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    lrs: list[float] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    val_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (updates, loss)

    def to_extra(self, batches_drawn: int, run: dict) -> dict:
        """JSON for ``Checkpointer.save(..., extra=...)``: numbers and lists of floats."""
        floats = lambda xs: [json_float(x) for x in xs]
        return {
            "step": len(self.losses),
            "batches_drawn": batches_drawn,
            "losses": floats(self.losses),
            "grad_norms": floats(self.grad_norms),
            "lrs": floats(self.lrs),
            "step_seconds": floats(self.step_seconds),
            "val_losses": [[s, json_float(v)] for s, v in self.val_losses],
            "run": run,
        }

    @classmethod
    def from_extra(cls, extra: dict) -> Curve:
        floats = lambda xs: [float(x) for x in xs]
        return cls(
            losses=floats(extra["losses"]),
            grad_norms=floats(extra["grad_norms"]),
            lrs=floats(extra["lrs"]),
            step_seconds=floats(extra["step_seconds"]),
            val_losses=[(int(s), float(v)) for s, v in extra["val_losses"]],
        )


def log_step(log: logging.Logger, curve: Curve, i: int, tokens_per_step: int) -> None:
    dt = curve.step_seconds[i]
    log.info(
        "step %d loss %.4f grad_norm %.4f lr %.2e step_s %.3f tokens_per_s %.0f",
        *(i, curve.losses[i], curve.grad_norms[i], curve.lrs[i], dt, tokens_per_step / dt),
    )


def log_eval(log: logging.Logger, steps_done: int, val_loss: float) -> None:
    log.info("validation loss %.4f after %d steps", val_loss, steps_done)


def replay(log: logging.Logger, curve: Curve, tokens_per_step: int) -> None:
    """Logs a restored curve in the order and format a run logs it in as it goes."""
    evals = dict(curve.val_losses)
    if 0 in evals:
        log_eval(log, 0, evals[0])
    for i in range(len(curve.losses)):
        if i + 1 in evals:
            log_eval(log, i + 1, evals[i + 1])
        log_step(log, curve, i, tokens_per_step)


def load_average() -> list[float] | None:
    """The machine's load average over 1, 5 and 15 minutes (None where the OS has none):
    other jobs on the machine slow the run's wall time and tokens/s, not its CPU time."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def say(log: logging.Logger, line: str) -> None:
    """``line`` printed (on process 0) and logged."""
    echo(line)
    log.info("%s", line)


def describe_run(args, cfg, devices, n_params: int, train_text, val_text, n_val: int):
    """The run in three lines: devices and model, the training budget, the data."""
    where = f"{len(devices)} x {devices[0].platform}"
    if jax.process_count() > 1:
        where += f", {jax.process_count()} processes x {jax.local_device_count()}"
    tokens = args.steps * args.batch_size * cfg.seq_len
    return [
        f"stage {args.stage} on {len(devices)} devices ({where}): GPT {n_params:,} params, "
        f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"{cfg.seq_len}-byte context, {jnp.dtype(cfg.dtype).name}",
        f"training: {args.steps} steps x {args.batch_size} windows of {cfg.seq_len} bytes = "
        f"{tokens:,} bytes, {tokens / len(train_text):.3g} passes over the training text",
        f"data: the King James Bible, {len(train_text):,} bytes to train on, "
        f"{len(val_text):,} held out ({args.val_fraction:.3g} of the chapters, whole), "
        f"scored on {n_val} windows of {cfg.seq_len} bytes every {args.eval_every} steps",
    ]


def describe_figures(args, cfg, devices, n_params: int, train_text, val_text, n_val: int):
    """:func:`describe_run`'s figures for summary.json."""
    return {
        "stage": args.stage,
        "devices": len(devices),
        "processes": jax.process_count(),
        "platform": devices[0].platform,
        "params": n_params,
        "model": {
            "layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "heads": cfg.n_heads,
            "seq_len": cfg.seq_len,
            "dtype": jnp.dtype(cfg.dtype).name,
        },
        "steps": args.steps,
        "batch_size": args.batch_size,
        "tokens_per_step": args.batch_size * cfg.seq_len,
        "train_bytes": len(train_text),
        "val_bytes": len(val_text),
        "val_windows": n_val,
        "flags": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


def resumed_lines(args, ckpt, restored, n_devices: int, run_flags: dict) -> list[str]:
    """What a resumed run says: from where, what it skipped, which flags changed."""
    meta = ckpt.metadata(restored.step)
    line = (
        f"resumed from checkpoint step {restored.step} in {args.checkpoint_dir} (saved at "
        f"stage {meta['stage']} on {meta['devices']} devices, now stage {args.stage} on "
        f"{n_devices}), continuing to step {args.steps}"
    )
    line += "".join(
        f"; skipped invalid step {s}: {' '.join(why.split())}" for s, why in restored.skipped
    )
    saved_flags = restored.extra.get("run", {})
    changed = [
        f"--{k.replace('_', '-')} {run_flags[k]} (checkpoint: {saved_flags[k]})"
        for k in RUN_FLAGS
        if k in saved_flags and saved_flags[k] != run_flags[k]
    ]
    if not changed:
        return [line]
    return [line, f"note: {', '.join(changed)}: the rest differs from an uninterrupted run"]


def write_sample(args, cfg, params, train_text, val_text, log) -> dict:
    """Samples ``--sample-tokens`` bytes after ``--prompt``, prints them with the longest
    span they share with the training text, and returns summary.json's ``sample``."""
    tokens = sample(cfg, params, args.prompt, args.sample_tokens, args.temperature, args.seed)
    text = data.decode(tokens)
    head = f"{args.sample_tokens} bytes after {args.prompt!r}, temperature {args.temperature:g}"
    print(f"--- sample: {head} ---\n{text}\n---")
    log.info("sample %r", text)
    span, held_out = run_summary.shared_spans(tokens, train_text, val_text)
    shared = data.decode(tokens[span.sample_start : span.sample_start + span.length])
    line = (
        f"longest span shared with the training text: {span.length} bytes, {shared!r} "
        f"(held-out passages of the same {len(tokens)} bytes share {min(held_out)} to "
        f"{max(held_out)}, median {int(np.median(held_out))})"
    )
    say(log, line)
    return {
        "prompt": args.prompt,
        "temperature": args.temperature,
        "text": text,
        "shared_span_bytes": span.length,
        "shared_span_text": shared,
        "held_out_shared_span_bytes": held_out,
    }


def saved_steps(directory: Path) -> list[int]:
    """The finished checkpoints in ``directory`` (none if it does not exist)."""
    if not directory.is_dir():
        return []
    ckpt = jzero.Checkpointer(directory)
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def main(argv: list[str] | None = None) -> int:
    started = Clock.now()
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.checkpoint_dir is None:
        if args.resume:
            parser.error("--resume needs --checkpoint-dir DIR, the directory to resume from")
        if args.save_every is not None:
            parser.error("--save-every needs --checkpoint-dir DIR, where the checkpoints go")
    if not args.timeout >= 1:
        parser.error(f"--timeout {args.timeout:g} is below 1 second (default 300)")
    devices = setup_devices(args.cpu_devices, timeout=args.timeout)
    ds = None
    if args.deepspeed_config is not None:
        ds = apply_deepspeed_config(parser, args, argv, len(devices))
    if args.stage == "auto":
        check_auto(parser, args, argv)
    elif args.device_budget is not None or args.host_budget is not None:
        parser.error("--device-budget and --host-budget are for --stage auto")
    if args.stage == 0 and args.offload:
        parser.error(
            "--offload needs --stage 1, 2 or 3: at stage 0 every device holds the whole "
            "optimizer state"
        )
    if args.stage not in (3, "auto") and args.offload_params:
        parser.error(
            f"--offload-params needs --stage 3: at stage {args.stage} every device holds the "
            "whole parameters, and only stage 3's shards can rest in host memory"
        )
    if args.stage == 0 and args.grad_quant is not None:
        parser.error(
            f"--grad-quant {args.grad_quant} needs --stage 1, 2 or 3: it quantizes their "
            "gradient reduce-scatter, and stage 0 all-reduces"
        )
    # Each device takes batch-size / devices rows, split again into grad-accum micro-batches.
    n, k = len(devices), args.grad_accum
    if args.batch_size % (n * k):
        parser.error(
            f"--batch-size {args.batch_size} does not split over {n} device{'s' * (n > 1)} × "
            f"{k} micro-batch{'es' * (k > 1)}; use a multiple of {n * k}"
        )
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction {args.val_fraction} is not between 0 and 1 (default 0.1)")
    corpus = data.load_corpus()
    chapters = len(data.chapter_starts(corpus))
    if not data.held_out_chapters(chapters, args.val_fraction).any():
        parser.error(
            f"--val-fraction {args.val_fraction:g} holds out none of the {chapters:,} "
            f"chapters; use at least 1/{chapters} = {1 / chapters:.2g}"
        )
    train_text, val_text = data.split(corpus, args.val_fraction)
    if len(val_text) < args.seq_len + 1 or len(train_text) < args.seq_len + 2:
        parser.error(
            f"--seq-len {args.seq_len} needs windows of {args.seq_len + 1} bytes, but "
            f"--val-fraction {args.val_fraction} splits the {len(corpus):,}-byte text into "
            f"{len(train_text):,} training and {len(val_text):,} held-out bytes; "
            "lower --seq-len or change --val-fraction"
        )
    ckpt = None
    if args.checkpoint_dir is not None:
        if args.checkpoint_dir.exists() and not args.checkpoint_dir.is_dir():
            parser.error(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory")
        steps = saved_steps(args.checkpoint_dir)
        if args.resume and not steps:
            parser.error(
                f"--resume: no checkpoint in {args.checkpoint_dir}; "
                "leave out --resume to start a new run there"
            )
        if steps and not args.resume:
            parser.error(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (the newest "
                f"at step {steps[-1]}); add --resume to continue that run, or use an empty "
                "directory"
            )
        # Every process has looked at the directory before the next line creates it.
        sync_processes("train_lm: --checkpoint-dir checked")
        ckpt = jzero.Checkpointer(
            args.checkpoint_dir, max_to_keep=KEEP, save_every=args.save_every or SAVE_EVERY
        )
    if jzero.distributed.is_main_process():
        args.out.mkdir(parents=True, exist_ok=True)
    log = make_logger(args.out)
    try:
        return run(args, parser, devices, train_text, val_text, log, ckpt, ds, started)
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the asynchronous saves in flight, also when interrupted
        for handler in list(log.handlers):
            handler.close()
            log.removeHandler(handler)


def run(args, parser, devices, train_text, val_text, log, ckpt, ds, started) -> int:
    log.info("args %s", vars(args))

    # ---------------------------------------------------------------- model and data
    precision = run_precision(args, ds)
    cfg = gpt.GPTConfig(
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        dtype=precision.param_dtype,
    )
    batches = data.batches(
        train_text, batch_size=args.batch_size, seq_len=cfg.seq_len, seed=args.seed
    )

    # ---------------------------------------------------------------- jzero
    mesh = jzero.data_mesh(devices)
    # init_fn runs under jit with sharded outputs: in stage 3 no device holds the whole model.
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(args.seed))
    auto = choose_config(args, parser, cfg, mesh, init_fn, log) if args.stage == "auto" else None
    opt, schedule = make_optimizer(args, mesh, ds, config=auto, cfg=cfg)
    shapes = jax.eval_shape(init_fn)
    curve, batches_drawn, resumed = Curve(), 0, None
    run_flags = {name: getattr(args, name) for name in RUN_FLAGS}
    if args.resume:
        # The newest valid checkpoint, laid out for this optimizer's stage and devices.
        try:
            restored = ckpt.restore(opt, shapes)
        except jzero.checkpoint.CheckpointError as e:
            parser.error(f"--resume: {e}")
        try:
            curve = Curve.from_extra(restored.extra)
            batches_drawn = int(restored.extra["batches_drawn"])
        except (TypeError, KeyError, ValueError):
            parser.error(
                f"--resume: checkpoint step {restored.step} in {args.checkpoint_dir} has no "
                "loss curve and data position; it was not written by this script"
            )
        if restored.step > args.steps:
            parser.error(
                f"--steps {args.steps} is the total, but the checkpoint is at step "
                f"{restored.step} already; pass --steps {restored.step} or more"
            )
        state, resumed = restored.state, restored.step
        for _ in range(batches_drawn):  # the data position: the same batches as without a stop
            next(batches)
    else:
        state = opt.init(init_fn=init_fn)
    # Validation: the same --val-windows windows of the held-out chapters every time, padded
    # to whole windows per device. They are scored on the full parameters (gathered,
    # replicated), the windows split over 'data' (each process places its own:
    # global_batch, as for the training batches).
    val_windows = data.eval_windows(
        val_text, seq_len=cfg.seq_len, multiple_of=len(devices), count=args.val_windows
    )
    n_val = int(val_windows["weight"].sum())
    val_windows = global_batch(mesh, val_windows)
    eval_loss = make_eval_loss(cfg)
    n_params = gpt.count_params(shapes)
    for line in describe_run(args, cfg, devices, n_params, train_text, val_text, n_val):
        say(log, line)
    log.info("%s", layout_summary(state))
    if args.verbose:
        echo(layout_summary(state))
    tokens_per_step = args.batch_size * cfg.seq_len
    if args.resume:
        for line in resumed_lines(args, ckpt, restored, len(devices), run_flags):
            say(log, line)
        replay(log, curve, tokens_per_step)  # the run so far, as it was logged
    # manual_gather: the model gathers each layer's parameters inside its nn.scan body.
    train_step = opt.train_step(
        gpt.make_loss_fn(cfg), manual_gather=True, grad_accum=args.grad_accum
    )

    # ---------------------------------------------------------------- train
    def evaluate(steps_done: int) -> float:
        val_loss = float(eval_loss(opt.full_params(state), val_windows))
        curve.val_losses.append((steps_done, val_loss))
        log_eval(log, steps_done, val_loss)
        return val_loss

    start = len(curve.losses)  # updates done: 0, or the checkpoint's step
    val_loss = curve.val_losses[-1][1] if curve.val_losses else evaluate(0)
    save_every = args.save_every or SAVE_EVERY
    batch = None
    on_terminal = sys.stderr.isatty()
    bar = tqdm(
        range(start, args.steps),
        desc=f"zero{args.stage}",
        initial=start,
        total=args.steps,
        dynamic_ncols=True,
        # Off a terminal (a log file, CI) every redraw is a line: one a minute, not 10 a second.
        # miniters=1 there keeps tqdm's monitor thread from redrawing every 10 s as well.
        mininterval=0.1 if on_terminal else 60.0,
        miniters=None if on_terminal else 1,
        disable=not jzero.distributed.is_main_process(),
    )
    # Multi-process: a lost peer ends every survivor with a message (and exit status 1)
    # within 0.9 x --timeout, before JAX's own heartbeat timeout (--timeout) would.
    with bounded(0.9 * args.timeout) as watchdog:
        for step in bar:
            # Every process draws the same global batch and places only its rows.
            batch = global_batch(mesh, next(batches))  # {"tokens": int32[B, T+1]}
            batches_drawn += 1
            t0 = time.perf_counter()
            state, metrics = train_step(state, batch)
            loss = float(metrics["loss"])  # waits for the step
            dt = time.perf_counter() - t0
            curve.losses.append(loss)
            curve.grad_norms.append(float(metrics["grad_norm"]))
            curve.lrs.append(float(schedule(step)))
            curve.step_seconds.append(dt)
            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                val_loss = evaluate(done)
            tok_s = f"{tokens_per_step / dt:,.0f}"
            postfix = {"loss": f"{loss:.3f}", "val": f"{val_loss:.3f}", "tok_s": tok_s}
            bar.set_postfix(postfix, refresh=False)  # shown at the next redraw mininterval allows
            log_step(log, curve, step, tokens_per_step)
            if ckpt is not None and (done % save_every == 0 or done == args.steps):
                # Asynchronous: returns once the arrays are off the devices; the next step
                # may donate them. `extra` carries what the arrays do not: data position
                # and curve.
                extra = curve.to_extra(batches_drawn, run_flags)
                ckpt.save(done, state, extra=extra, force=done == args.steps)
            watchdog.beat()
    bar.close()
    if ckpt is not None:
        ckpt.wait()
        say(log, f"checkpoints: steps {ckpt.all_steps()} in {args.checkpoint_dir}")

    params = opt.full_params(state)  # for the sample; a gather every process takes part in
    if batch is None:  # resumed at --steps: no step ran here; any batch shows the layout
        batch = global_batch(mesh, next(batches))
    for line in progress.curve_table(curve.losses, curve.val_losses):
        echo(line)
    for line in run_summary.loss_lines(curve.losses, curve.val_losses):
        say(log, line)
    if not jzero.distributed.is_main_process():
        return 0  # the plot, the sample, summary.json and the report are process 0's

    title = f"GPT ({n_params / 1e6:.2f}M params) on the King James Bible, ZeRO stage {args.stage}"
    run_summary.plot_curves(
        args.out / "loss.png", curve.losses, curve.val_losses, resumed=resumed, title=title
    )
    # This invocation's steps (after a resume, the restored ones ran elsewhere).
    tokens_per_s = run_summary.throughput(curve.step_seconds[start:], tokens_per_step)
    if tokens_per_s is not None:
        line = f"throughput: {tokens_per_s:,.0f} tokens/s on {len(devices)} devices"
        say(log, f"{line} (training steps, the first left out: it compiles)")
    summary = {
        **describe_figures(args, cfg, devices, n_params, train_text, val_text, n_val),
        **run_summary.loss_figures(curve.losses, curve.val_losses),
        "tokens_per_s": tokens_per_s,
        "sample": write_sample(args, cfg, params, train_text, val_text, log),
    }
    if args.verbose:
        print(jzero.report(train_step, state, batch))
    elapsed = started.elapsed()
    say(log, f"time: {progress.duration(elapsed.wall)} wall, {elapsed.cpu:.0f} s CPU")
    summary |= {"wall_s": elapsed.wall, "cpu_s": elapsed.cpu, "load_average": load_average()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out / 'train.log'}, {args.out / 'loss.png'}, {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
