"""Start N real JAX processes on 127.0.0.1 (gloo CPU collectives) and collect what they say."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from _paths import REPO, TESTS

# The training runs of mp_worker.py's "train" mode: name -> (stage, Communication keywords).
# "3-int8": ZeRO++'s int8 all-gathers (qwZ) and int8 gradient all-to-alls (qgZ) crossing
# processes.
TRAIN_RUNS = {
    **{str(stage): (stage, {}) for stage in range(4)},
    "3-int8": (3, {"gather_quant": "int8", "grad_quant": "int8"}),
}


class Finished(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the launch to this process's exit


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    script: str | Path,
    n: int,
    *args: str,
    local_devices: int,
    timeout: float,
    grace: float | None = None,
) -> list[Finished]:
    """Runs ``python script *args`` as processes 0..n-1 of one run, each with
    ``local_devices`` CPU devices, the environment ``jzero.distributed.initialize`` reads,
    and a hard ``timeout`` (every process still running then is killed). With ``grace``,
    the others are killed that many seconds after process 0 exits (e.g. a frozen peer)."""
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JZERO_COORDINATOR": f"127.0.0.1:{port}",
        "JZERO_NUM_PROCESSES": str(n),
        "JZERO_LOCAL_CPU_DEVICES": str(local_devices),
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]),
    }
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "JZERO_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    done: list[Finished | None] = [None] * n
    while any(d is None for d in done):
        for i, p in enumerate(procs):
            if done[i] is None and p.poll() is not None:
                out, err = p.communicate()
                done[i] = Finished(p.returncode, out, err, time.monotonic() - start)
        late = (
            grace is not None
            and done[0] is not None
            and time.monotonic() - start > done[0].seconds + grace
        )
        if late or time.monotonic() - start > timeout:
            for i, p in enumerate(procs):
                if done[i] is None:
                    p.kill()
                    out, err = p.communicate()
                    done[i] = Finished(-9, out, err, time.monotonic() - start)
        time.sleep(0.05)
    return done  # type: ignore[return-value]
