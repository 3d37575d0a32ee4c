"""One process of a frozen-peer run (started by scripts/frozen_peer_trials.py).

``mp_failure_worker.py TIMEOUT WATCHDOG FROZEN STEP DELAY``: joins the run with
``jzero.distributed.initialize(timeout=TIMEOUT)`` and trains a small MLP at stage 3 under
``bounded()`` (``bounded(WATCHDOG)`` when WATCHDOG > 0); process FROZEN (-1: none) stops
itself with SIGSTOP DELAY seconds after finishing step STEP, from a thread, so the main
thread may be anywhere in a later step (DELAY < 0: from the main thread, -DELAY seconds
after step STEP, so that its last finished step is STEP). Prints ``FREEZE <time.time()>
<last finished step>`` just before stopping and ``RESUMED <time.time()>`` after a SIGCONT;
with no freeze, stops after STEP + 5 steps and prints ``DONE``.
"""

import os
import signal
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["JZERO_LOCAL_CPU_DEVICES"]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402

TIMEOUT, WATCHDOG = float(sys.argv[1]), float(sys.argv[2])
FROZEN, STEP, DELAY = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])

jzero.distributed.initialize(timeout=TIMEOUT)
rank = jax.process_index()
mesh = jzero.data_mesh()


def loss_fn(params, batch):
    params = jzero.gather(params)
    h_BxH = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h_BxH @ params["w2"] - batch["y"]) ** 2)


rng = np.random.default_rng(0)
params = {
    "w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
    "b1": jnp.zeros((32,), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(32, 4)) * 0.3, jnp.float32),
}
rows = {
    "x": rng.normal(size=(8, 16)).astype(np.float32)[rank * 4 : rank * 4 + 4],
    "y": rng.normal(size=(8, 4)).astype(np.float32)[rank * 4 : rank * 4 + 4],
}
opt = jzero.ZeroOptimizer(optax.sgd(1e-2), mesh, stage=3)
state, train_step = opt.init(params), opt.train_step(loss_fn)
batch = jzero.distributed.global_batch(mesh, rows)
finished = 0


def freeze(delay: float) -> None:
    time.sleep(delay)
    print(f"FREEZE {time.time():.3f} {finished}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    print(f"RESUMED {time.time():.3f}", flush=True)


with jzero.distributed.bounded(WATCHDOG if WATCHDOG > 0 else None) as watchdog:
    for step in range(1, 1_000_000):
        state, metrics = train_step(state, batch)
        float(metrics["loss"])
        finished = step
        watchdog.beat()
        if step == STEP and rank == FROZEN and DELAY < 0:
            freeze(-DELAY)
        elif step == STEP and rank == FROZEN:
            threading.Thread(target=freeze, args=(DELAY,), daemon=True).start()
        if FROZEN < 0 and step == STEP + 5:
            break
print("DONE", flush=True)
