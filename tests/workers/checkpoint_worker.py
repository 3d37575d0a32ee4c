"""The subprocess half of tests/checkpoint/test_checkpoint_errors.py: cases that used to
crash or hang the process, each run in a fresh interpreter so that a segfault or a hang
fails the test instead of killing (or stalling) pytest.

``python tests/workers/checkpoint_worker.py MODE DIRECTORY`` prints one line per outcome (``what =>
outcome``), then ``exiting``:

- ``donated``: save and export a state that a train step consumed (its buffers donated),
  after the checksum and gather programs for its shapes were compiled: jaxlib 0.10.2 can
  segfault when a compiled program is handed a deleted buffer.
- ``failing``: saves that fail -- one whose directory became a regular file (fails in
  ``save``), then writes past ``RLIMIT_FSIZE`` ("File too large", in the background, as a
  full disk would; works as root, unlike chmod) reported by the next ``save``, ``wait``,
  ``close`` and non-due ``save`` -- after which the process must exit at once.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _models import awkward_batches, awkward_loss, awkward_params  # noqa: E402

import jzero  # noqa: E402
from jzero.checkpoint import Checkpointer, CheckpointSaveError, export_safetensors  # noqa: E402


def outcome(name: str, call) -> None:
    try:
        print(f"{name} => returned {call()}", flush=True)
    except (ValueError, RuntimeError) as e:  # CheckpointSaveError is a ValueError
        print(f"{name} => {type(e).__name__}: {e}", flush=True)


def donated(root: str) -> None:
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3, min_shard_size=1)
    state = opt.init(awkward_params())
    with Checkpointer(os.path.join(root, "warm")) as ckpt:  # compiles the checksum program
        ckpt.save(1, state)
    export_safetensors(opt, state, os.path.join(root, "warm.safetensors"))  # and the gathers
    new_state, _ = opt.train_step(awkward_loss)(state, awkward_batches(1, batch_size=24)[0])
    ckpt = Checkpointer(os.path.join(root, "ckpt"))
    outcome("save", lambda: ckpt.save(1, state))
    outcome("export", lambda: export_safetensors(opt, state, os.path.join(root, "x.safetensors")))
    outcome("save of the new state", lambda: ckpt.save(2, new_state))
    ckpt.close()
    print("exiting", flush=True)


def failing(root: str) -> None:
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)
    state = opt.init({"w": jax.random.normal(jax.random.key(0), (512, 512))})  # 1 MiB
    gone = Checkpointer(os.path.join(root, "gone"))
    outcome("gone: save 0", lambda: gone.save(0, state) and gone.wait())
    shutil.rmtree(gone.directory)
    with open(gone.directory, "w") as f:  # the directory is now a regular file
        f.write("not a directory")
    outcome("gone: save 1", lambda: gone.save(1, state))
    os.remove(gone.directory)
    outcome("gone: save 2", lambda: gone.save(2, state))  # the cause fixed: it saves again
    gone.close()

    full = Checkpointer(os.path.join(root, "full"))
    every10 = Checkpointer(os.path.join(root, "every10"), save_every=10)
    outcome("full: save 0", lambda: full.save(0, state))
    outcome("every10: save 0", lambda: every10.save(0, state))
    full.wait()
    every10.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    outcome("full: save 1", lambda: full.save(1, state))
    outcome("full: save 2", lambda: full.save(2, state))  # reports step 1, starts nothing
    outcome("full: save 2 again", lambda: full.save(2, state))
    outcome("full: wait", full.wait)  # reports step 2
    outcome("full: save 3", lambda: full.save(3, state))
    outcome("full: close", full.close)  # reports step 3, after releasing Orbax
    outcome("every10: save 10", lambda: every10.save(10, state))
    deadline = time.monotonic() + 30  # the background write fails within about a second
    calls = 0
    while time.monotonic() < deadline:
        try:
            every10.save(11, state)  # not due: writes nothing, reports the failure once known
        except CheckpointSaveError as e:
            print(f"every10: save 11 (not due) => {type(e).__name__}: {e}", flush=True)
            break
        calls += 1
        time.sleep(0.01)
    print(f"every10: calls before => {calls}", flush=True)
    outcome("every10: close", every10.close)
    print("exiting", flush=True)


if __name__ == "__main__":
    {"donated": donated, "failing": failing}[sys.argv[1]](sys.argv[2])
