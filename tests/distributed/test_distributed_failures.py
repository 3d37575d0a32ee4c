"""Multi-process start-up and a frozen peer: jzero's message comes first and names it.

Refused start-up inputs raise before JAX is touched (no processes needed). The timeouts:
``initialize(timeout=T)`` gives JAX a heartbeat whose earliest abort comes after the
watchdog has spoken, for every T, and a ``bounded`` timeout too close to that abort is
refused. Real processes on 127.0.0.1 (2 x 2 CPU devices): a SIGSTOPped process, whether
it hosts JAX's coordination service or not, is named with its last finished step by the
survivor, which exits with jzero's message and no JAX abort; resumed, the frozen process
says it was stopped and blames no peer. A single process stopped for a while carries on.
"""

from __future__ import annotations

import importlib.util
import io
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _multiprocess import REPO, run_processes
from _paths import WORKERS

import jzero
from jzero.distributed import progress, runtime, watchdog
from jzero.internal import coordination

HOW_TO = (
    "Give process 0's host and a free TCP port as 'host:port', e.g. '10.0.0.1:1234', "
    "'127.0.0.1:1234' (one machine) or '[::1]:1234' (IPv6 in brackets)."
)


def _trials():
    spec = importlib.util.spec_from_file_location(
        "trials", REPO / "scripts" / "frozen_peer_trials.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "address, problem",
    [
        ("127.0.0.1:99999", "port 99999 is outside 1-65535"),
        ("127.0.0.1:0", "port 0 is outside 1-65535"),
        ("localhost", "has no port"),
        ("localhost:http", "port 'http' is not a number"),
        (":1234", "has no host"),
        ("::1:1234", "is an IPv6 address without brackets"),
        ("[::1:1234", "has an unclosed '[' or ']' around the host"),
        ("[not-ipv6]:1234", "has no IPv6 address in brackets"),
        ("http://10.0.0.1:1234", "has a URL scheme; drop it"),
        ("10.0.0.1 :1234", "is empty or contains spaces"),
        ("", "is empty or contains spaces"),
        (1234, "must be a str, not int"),
    ],
)
def test_initialize_refuses_a_bad_address_naming_it_and_the_fix(address, problem):
    with pytest.raises(ValueError) as e:
        jzero.distributed.initialize(address, 2, 0)
    assert str(e.value) == f"coordinator_address {address!r}: {problem}. {HOW_TO}"


@pytest.mark.parametrize("env", ["JZERO_COORDINATOR", "JAX_COORDINATOR_ADDRESS"])
def test_an_address_from_the_environment_is_checked_and_named(env, monkeypatch):
    monkeypatch.delenv("JZERO_COORDINATOR", raising=False)
    monkeypatch.setenv(env, "localhost")
    with pytest.raises(ValueError, match=rf"^\${env} 'localhost': has no port\. Give"):
        jzero.distributed.initialize(num_processes=2, process_id=0)


@pytest.mark.parametrize(
    "address", ["localhost:1234", "10.0.0.1:65535", "[::1]:1", "[fe80::1%eth0]:8476"]
)
def test_good_addresses_pass_unchanged(address):
    assert runtime.check_coordinator_address(address) == address


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_processes": "2"}, TypeError, "num_processes is '2', a str (the argument); pass an"),
        ({"process_id": 1.0}, TypeError, "process_id is 1.0, a float (the argument); pass an"),
        ({"process_id": True}, TypeError, "process_id is True (the argument); pass an int."),
        ({"num_processes": 0}, ValueError, "num_processes is 0; a run has at least 1 process."),
        ({"process_id": -1}, ValueError, "process_id is -1; processes count from 0."),
        ({"process_id": 2}, ValueError, "process_id 2 is outside 0..1 (num_processes=2)"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a number of seconds >= 1"),
        ({"timeout": True}, ValueError, "timeout must be a number of seconds >= 1"),
    ],
)
def test_initialize_refuses_bad_process_counts_and_timeouts(kwargs, error, message):
    kwargs = {"num_processes": 2, "process_id": 0, **kwargs}
    with pytest.raises(error) as e:
        jzero.distributed.initialize("127.0.0.1:1234", **kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_numpy_integers_are_taken_as_ints(monkeypatch):
    for env in ("JZERO_COORDINATOR", "JZERO_NUM_PROCESSES", "JZERO_PROCESS_ID"):
        monkeypatch.delenv(env, raising=False)
    got = runtime.resolve_arguments("127.0.0.1:1234", np.int64(2), np.int32(1))
    assert got == ("127.0.0.1:1234", 2, 1)
    assert [type(x) for x in got[1:]] == [int, int]


def test_jax_heartbeat_comes_after_the_watchdog_for_every_timeout():
    assert [runtime.heartbeat_timeout(t) for t in (1, 2.5, 5, 10, 120)] == [7, 12, 19, 34, 364]
    for timeout in np.arange(1.0, 1000.0, 0.25):
        timeouts = runtime.Timeouts(timeout=timeout, heartbeat=runtime.heartbeat_timeout(timeout))
        # bounded() takes T: it has spoken 2 s (and 0.5 T) before JAX's earliest abort
        room = timeouts.earliest_jax_abort - watchdog.latest_message(timeout)
        assert room >= max(watchdog.MARGIN, 0.5 * timeout - 1e-9), timeout


def test_bounded_takes_initializes_timeout_and_refuses_one_too_close_to_jax(monkeypatch):
    monkeypatch.setattr(runtime, "_timeouts", None)
    with pytest.raises(ValueError, match=r"^bounded\(\) has no timeout: pass timeout=SECONDS"):
        watchdog.watchdog_timeout(None)
    assert watchdog.watchdog_timeout(1000) == 1000.0  # heartbeat unknown: nothing to check

    monkeypatch.setattr(runtime, "_timeouts", runtime.Timeouts(timeout=10.0, heartbeat=34))
    assert watchdog.watchdog_timeout(None) == 10.0
    assert watchdog.watchdog_timeout(5) == 5.0
    assert watchdog.watchdog_timeout(13) == 13.0  # speaks by 15 s: JAX at 17 s, 2 s to spare
    with pytest.raises(ValueError) as e:
        watchdog.watchdog_timeout(13.5)
    assert str(e.value) == (
        "bounded(timeout=13.5) could be too late: jzero.distributed.initialize(timeout=10) "
        "gave JAX a 34 s heartbeat timeout, whose abort (a C++ stack trace, no word of which "
        "process stalled) can come 17 s after a peer freezes; this watchdog speaks up to "
        "15.5 s after the last step and must leave 2 s. Use bounded(timeout<=13), or "
        "bounded() (it takes 10), or initialize(timeout>=10.33)."
    )
    monkeypatch.setattr(runtime, "_timeouts", runtime.Timeouts(timeout=1.0, heartbeat=7))
    assert watchdog.watchdog_timeout(1.0) == 1.0
    with pytest.raises(
        ValueError, match=r"Use bounded\(timeout<=1\), or bounded\(\) \(it takes 1\)"
    ):
        watchdog.watchdog_timeout(1.2)


def _entries(monkeypatch, values):
    now = time.time()
    table = {
        f"{progress.DIRECTORY}/{p}": f'{{"step": {s}, "time": {now - age}}}'
        for p, (s, age) in values.items()
    }
    monkeypatch.setattr(coordination, "entries", lambda directory: table)


def _report(me=0, count=4, step=20, wait=0.5, seen=None):
    publisher = progress.Publisher(me, count, lambda: step, 1.0)  # not started
    publisher.coordinator_seen = seen
    return progress.stall_report(me, count, step, stale_after=5.0, wait=wait, publisher=publisher)


def test_stall_report_names_silent_lagging_and_missing_processes(monkeypatch):
    _entries(monkeypatch, {0: (20, 0.1), 1: (20, 6.0), 2: (18, 0.2)})  # process 3 never
    assert re.fullmatch(
        r"processes 1 \(last finished step 20, silent for 6\.\d s\), 2 \(last finished step "
        r"18, silent for 0\.\d s\), 3 \(no step reported\) stalled: frozen, dead, or stuck "
        r"outside the collectives\. This process finished step 20\.",
        _report(),
    )
    _entries(monkeypatch, {0: (20, 0.0), 1: (20, 0.3), 2: (20, 0.9), 3: (20, 4.0)})
    assert _report() == (
        "every process reported recently and finished step 20: one step became slower than "
        "the timeout (raise it), or a collective is stuck."
    )


def test_stall_report_when_the_store_is_silent_or_fails(monkeypatch):
    monkeypatch.setattr(coordination, "entries", lambda directory: time.sleep(30))
    seen = progress.Progress(step=19, time=time.time() - 7.0)
    assert re.fullmatch(
        r"process 0 \(last finished step 19, silent for 7\.\d s\) hosts JAX's coordination "
        r"service and did not answer within 0\.2 s: it is frozen or dead\. This process "
        r"finished step 20\.",
        _report(me=1, wait=0.2, seen=seen),
    )

    def fail(directory):
        raise RuntimeError("UNAVAILABLE: Socket closed\nmore")

    monkeypatch.setattr(coordination, "entries", fail)
    assert _report(me=1) == (
        "the other processes' progress could not be read (RuntimeError: UNAVAILABLE: Socket "
        "closed)."
    )


def test_the_leaving_line_is_one_write_so_no_cpp_log_lands_inside_it(monkeypatch):
    # JAX's C++ threads write to fd 2 too: a line printed as text then newline once took
    # a coordination-service error into its middle (CI, stop 55)
    writes = []
    monkeypatch.setattr(
        watchdog.os, "write", lambda fd, data: writes.append((fd, data)) or len(data)
    )
    watchdog._say("jzero: process 1 of 2: stopped.\n")
    assert writes == [(sys.stderr.fileno(), b"jzero: process 1 of 2: stopped.\n")]

    class Notebook:  # a stream without a file descriptor (as ipykernel's): printed whole
        def __init__(self):
            self.text = []

        def fileno(self):
            raise io.UnsupportedOperation("fileno")

        def write(self, text):
            self.text.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Notebook())
    watchdog._say("jzero: left.\n")
    assert "".join(sys.stderr.text) == "jzero: left.\n" and len(writes) == 1


def test_a_leaving_line_the_pipe_takes_in_parts_is_written_whole(monkeypatch):
    # a pipe may take a line longer than its buffer in parts: the rest is written again
    writes = []
    monkeypatch.setattr(
        watchdog.os, "write", lambda fd, data: writes.append(bytes(data[:7])) or min(7, len(data))
    )
    line = "jzero: process 1 of 2: a message longer than one write takes.\n"
    watchdog._say(line)
    assert b"".join(writes) == line.encode() and len(writes) == -(-len(line) // 7)


_STOPPABLE = (
    "import sys, time, jzero\n"
    "w = jzero.distributed.watchdog.Watchdog(float(sys.argv[1])).start()\n"
    "w.beat(); print('ready', flush=True)\n"
    "for step in range(2, 60):\n"
    "    time.sleep(0.1); w.beat(step)\n"
    "print('done', flush=True)\n"
)


def _stop_and_resume(timeout: float, seconds: float) -> subprocess.CompletedProcess:
    child = subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    child.send_signal(signal.SIGCONT)
    out, err = child.communicate(timeout=60)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_a_single_process_stopped_for_a_while_carries_on():
    # no peer gave up on it: neither the stop (longer than the timeout) nor the step it
    # interrupted ends the run; in a multi-process run it exits (tested below)
    for timeout, seconds in ((1.0, 3.0), (30.0, 1.5)):
        out = _stop_and_resume(timeout, seconds)
        assert out.returncode == 0 and out.stdout == "done\n" and out.stderr == "", out


@pytest.mark.slow  # real processes: in CI (-m ''), not in the quick default run
def test_bounded_without_a_timeout_runs_a_healthy_job_to_the_end():
    # initialize(timeout=5), bounded() and no freeze: every process ends normally
    results = run_processes(
        WORKERS / "mp_failure_worker.py",
        2,
        "5",
        "0",
        "-1",
        "3",
        "0",
        local_devices=2,
        timeout=180,
    )
    for r in results:
        assert r.returncode == 0 and r.stdout.strip().endswith("DONE"), r.stderr[-3000:]
        assert "jzero: process" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [1, 0])  # 0 hosts JAX's coordination service
def test_a_frozen_peer_is_named_first_and_when_resumed_blames_no_one(frozen):
    # initialize(timeout=5): watchdog 5 s, JAX heartbeat 19 s (earliest abort 9.5 s). The
    # frozen process stops after finishing step 3, from its main thread: 0.5 s after, or
    # 2.5 s for process 0, so that process 1's once-a-second publication has read process
    # 0's step 3 (a read right after step 3 races with process 0 publishing it)
    delay = -2.5 if frozen == 0 else -0.5
    trial = _trials().run_trial(timeout=5, watchdog=0, frozen=frozen, step=3, delay=delay)
    survivor = 1 - frozen
    assert trial["frozen_last_finished_step"] == 3
    assert trial["survivor_returncode"] == 1, trial["survivor_stderr_tail"]
    assert trial["first_to_speak"] == "jzero"  # and JAX's abort never came (status 1)
    head = rf"jzero: process {survivor} of 2: no training step finished in 5 s \(after step 3\): "
    named = rf"process {frozen} \(last finished step 3, silent for \d+\.\d s\) "
    tail = r"This process finished step 3\. Exiting; restart from the last checkpoint\."
    if frozen == 0:
        said = (
            named
            + r"hosts JAX's coordination service and did not answer within 1 s: "
            + r"it is frozen or dead\. "
        )
    else:
        said = named + r"stalled: frozen, dead, or stuck outside the collectives\. "
    assert re.fullmatch(head + said + tail, trial["message"]), trial["message"]
    # resumed (SIGCONT) after the survivor left: it knows it was the one stopped
    assert trial["resumed_exited"]
    assert re.fullmatch(
        rf"jzero: process {frozen} of 2: this process was stopped \(frozen\) for \d+\.\d s after "
        r"step 3, longer than the 5 s its peers' watchdogs wait: they have given up on it; no "
        r"peer failed\. Exiting; restart from the last checkpoint\.",
        trial["resumed_message"] or "",
    ), trial["resumed_message"]
