"""Frozen-peer trials: does jzero's watchdog speak before JAX's heartbeat abort, every time?

Each trial starts 2 processes on 127.0.0.1 (2 CPU devices each,
``tests/workers/mp_failure_worker.py``) training under ``jzero.distributed.bounded()``,
freezes one of them (SIGSTOP) at a random moment after a random step, and records which
came first in the survivor's output: jzero's message or JAX's abort (``Terminating process
because the JAX distributed service...``), and the seconds from the freeze to jzero's
message and to the survivor's exit. Then it resumes the frozen process (SIGCONT) and
records what that one says, and whether the step the survivor named is the one the frozen
process last finished. A run that fails before the freeze (e.g. at start-up) is reported
and replaced, not counted. Slow (start-up and the timeouts), CPU-light while frozen.

    .venv/bin/python scripts/frozen_peer_trials.py --trials 20 \
        --json benchmarks/frozen_peer_trials.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "mp_failure_worker.py"
JAX_ABORT = "Terminating process because the JAX distributed service"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A worker whose output lines are kept with the wall time they arrived."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.popen = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.lines
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.popen, name):
            self.lines[name].append((time.time(), line.rstrip("\n")))

    def wait(self, seconds: float) -> float | None:
        """Waits up to ``seconds`` for the exit; its wall time, or None (then killed)."""
        try:
            self.popen.wait(seconds)
            exited = time.time()
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            exited = None
        for reader in self._readers:
            reader.join(10)
        self.popen.stdout.close()
        self.popen.stderr.close()
        return exited

    def first(self, name: str, text: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines[name] if text in line), None)

    def tail(self, name: str, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[name][-n:])


def _spoke_first(process: _Process) -> str:
    """``"jzero"``, ``"jax"`` (JAX's abort before any jzero message) or ``"none"``."""
    for _, line in process.lines["stderr"]:
        if line.startswith("jzero: process"):
            return "jzero"
        if JAX_ABORT in line:
            return "jax"
    return "jax" if process.popen.returncode == -signal.SIGABRT else "none"


def run_trial(
    *,
    timeout: float,
    watchdog: float,
    frozen: int,
    step: int,
    delay: float,
    resume_after: float = 2.0,
    limit: float = 240.0,
) -> dict:
    """One trial: 2 processes, ``frozen`` stopped ``delay`` s after step ``step`` (see the
    worker), resumed ``resume_after`` s after the survivor exits. Every process is killed
    at ``limit`` s. Returns what happened, as a JSON-able dict."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JZERO_COORDINATOR": f"127.0.0.1:{_free_port()}",
        "JZERO_NUM_PROCESSES": "2",
        "JZERO_LOCAL_CPU_DEVICES": "2",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = [str(x) for x in (timeout, watchdog, frozen, step, delay)]
    procs = [
        _Process([sys.executable, str(WORKER), *args], {**env, "JZERO_PROCESS_ID": str(i)})
        for i in range(2)
    ]
    survivor, stopped = procs[1 - frozen], procs[frozen]
    start = time.time()
    survivor_exit = survivor.wait(limit)
    time.sleep(resume_after)
    if stopped.popen.poll() is None:
        stopped.popen.send_signal(signal.SIGCONT)
    stopped_exit = stopped.wait(max(1.0, limit - (time.time() - start)))
    freeze = stopped.first("stdout", "FREEZE")
    message = survivor.first("stderr", "jzero: process")
    resumed = stopped.first("stderr", "jzero: process")
    freeze_time = float(freeze[1].split()[1]) if freeze else None
    named = re.search(
        rf"process {frozen} \(last finished step (\d+)", message[1] if message else ""
    )

    def since_freeze(t: float | None) -> float | None:
        return None if t is None or freeze_time is None else round(t - freeze_time, 3)

    return {
        "frozen": frozen,
        "froze": freeze is not None,  # False: the run failed before (e.g. at start-up)
        "freeze_after_step": step,
        "freeze_delay_s": delay,
        "frozen_last_finished_step": int(freeze[1].split()[2]) if freeze else None,
        "reported_step": int(named.group(1)) if named else None,
        "survivor_returncode": survivor.popen.returncode,
        "first_to_speak": _spoke_first(survivor),
        "survivor_saw_jax_abort": survivor.first("stderr", JAX_ABORT) is not None,
        "seconds_to_message": since_freeze(message[0] if message else None),
        "seconds_to_exit": since_freeze(survivor_exit),
        "message": message[1] if message else None,
        "resumed_returncode": stopped.popen.returncode,
        "resumed_first_to_speak": _spoke_first(stopped),
        "resumed_message": resumed[1] if resumed else None,
        "resumed_exited": stopped_exit is not None,
        "survivor_stderr_tail": None if message else survivor.tail("stderr"),
    }


def summarize(trials: list[dict]) -> dict:
    def spread(key: str) -> dict:
        values = [t[key] for t in trials if t[key] is not None]
        if not values:
            return {"min": None, "median": None, "max": None}
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    def blames_a_peer(message: str | None) -> bool:
        return message is not None and ("stalled" in message or "peer process" in message)

    behind = [
        t["frozen_last_finished_step"] - t["reported_step"]
        for t in trials
        if t["reported_step"] is not None
    ]
    return {
        "trials": len(trials),
        "lost_races": sum(t["first_to_speak"] != "jzero" for t in trials),
        "survivor_saw_jax_abort": sum(t["survivor_saw_jax_abort"] for t in trials),
        "named_the_frozen_process": len(behind),
        "reported_step_exact": sum(b == 0 for b in behind),
        "reported_steps_behind_max": max(behind, default=None),
        "seconds_to_message": spread("seconds_to_message"),
        "seconds_to_exit": spread("seconds_to_exit"),
        "resumed_said_it_was_stopped": sum(
            "this process was stopped" in (t["resumed_message"] or "") for t in trials
        ),
        "resumed_blamed_a_peer": sum(blames_a_peer(t["resumed_message"]) for t in trials),
        "resumed_jax_abort_first": sum(t["resumed_first_to_speak"] == "jax" for t in trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=10.0, help="initialize(timeout=)")
    parser.add_argument(
        "--watchdog", type=float, default=0.0, help="bounded(timeout=); 0: bounded()"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the trials and summary here")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials {args.trials} is below 1")
    rng = random.Random(args.seed)
    trials, failed = [], []
    while len(trials) < args.trials and len(failed) < args.trials:
        trial = run_trial(
            timeout=args.timeout,
            watchdog=args.watchdog,
            frozen=rng.randrange(2),
            step=rng.randrange(3, 30),
            delay=round(rng.uniform(0.0, 0.05), 4),
        )
        if not trial["froze"]:  # never reached the freeze: not a trial, say why and retry
            failed.append(trial)
            print(f"run failed before the freeze:\n{trial['survivor_stderr_tail']}", flush=True)
            continue
        trials.append(trial)
        print(
            f"trial {len(trials)}/{args.trials}: froze process {trial['frozen']} after step "
            f"{trial['frozen_last_finished_step']}; first to speak: {trial['first_to_speak']} "
            f"(status {trial['survivor_returncode']}) after {trial['seconds_to_message']} s, "
            f"exit after {trial['seconds_to_exit']} s; resumed: {trial['resumed_message']}",
            flush=True,
        )
    summary = {**summarize(trials), "runs_failed_before_the_freeze": len(failed)}
    print(json.dumps(summary, indent=2))
    if args.json:
        import jax  # only for its version, recorded with the results

        from jzero.distributed import runtime

        result = {
            "jax": jax.__version__,
            "timeout": args.timeout,
            "watchdog": args.watchdog or args.timeout,
            "heartbeat": runtime.heartbeat_timeout(args.timeout),
            "earliest_jax_abort_s": runtime.heartbeat_timeout(args.timeout) / 2,
            "summary": summary,
            "trials": trials,
            "runs_failed_before_the_freeze": failed,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
