"""scripts/gpu_check.sh: the dry run (CPU, tiny sizes) runs every piece and part and
writes one JSON whose every target is PASS / FAIL or a skip with its reason; the
agreement piece compiles for compile-only H200s beside the CPU and skips its targets (CPU
memory is not GPU memory). The targets across parts (offload) and the agreement's are
computed exactly from recorded figures, and ``--only`` is read strictly; the compile-only
pieces (mock8, table2) are retired to CI."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _paths import GPU_PLUGIN, REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import catalog, driver  # noqa: E402  (scripts/gpu_check/)

PARTS = {
    "offload": ["none", "streamed", "host_step", "host_step_params"],
    "offload_fixed": ["none", "host_step", "streamed", "host_delayed", "ratio_half"],
    "offload_32k": ["none", "host_step", "streamed", "host_delayed", "ratio_half"],
}
MACHINE = {"jax", "platform", "device_kind", "devices", "device_bytes_limit", "host_memory_bytes"}


def _on_the_dry_run(test):
    """The dry run (13 minutes of CI's 2 cores) is one module-scoped fixture, run once: the
    file's tests share one xdist worker (tests/conftest.py). ``extended``
    (tests/_ci_tier.py): not in CI, for its time; a session lent a GPU runs it first, as
    the check's pre-flight (``bash scripts/gpu_check.sh --dry-run``)."""
    return pytest.mark.slow(pytest.mark.extended(test))


def _results(doc: dict) -> list[dict]:
    found = []
    for entry in doc["pieces"].values():
        found += [entry, *entry.get("parts", {}).values()]
    return found


def _check_target(t: dict) -> None:
    assert t["status"] in ("PASS", "FAIL", "SKIP"), t
    if t["status"] == "SKIP":
        assert t["reason"].startswith("skipped: ") and len(t["reason"]) > 20, t
    else:
        assert t["text"] and isinstance(t["measured"], float), t
        assert t["bound"] is not None, t


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path_factory.mktemp("gpu_check") / "out.json"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--json", str(path)],
        capture_output=True, text=True, timeout=1500, env=os.environ | {"PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(path.read_text())


@_on_the_dry_run
def test_dry_run_writes_every_piece_with_checked_or_explained_targets(dry_run):
    done, doc = dry_run
    assert doc["dry_run"] is True
    assert doc["machine"].keys() >= MACHINE and doc["machine"]["platform"] == "cpu"
    assert list(doc["pieces"]) == list(catalog.PIECES)
    for piece, parts in PARTS.items():
        assert list(doc["pieces"][piece]["parts"]) == parts
    for result in _results(doc):
        assert not result.get("error"), result["error"]
        for t in result["targets"]:
            _check_target(t)
    counts = {s: 0 for s in ("PASS", "FAIL", "SKIP")}
    for result in _results(doc):
        for t in result["targets"]:
            counts[t["status"]] += 1
    assert doc["summary"] == counts | {"errors": 0}
    assert f"summary: {doc['summary']}" in done.stdout
    n1 = doc["pieces"]["n1"]
    assert [t["name"] for t in n1["targets"]] == [f"n1 stage{k} time" for k in range(4)]
    assert [r["name"] for r in n1["runs"]] == ["plain_jit", "stage0", "stage1", "stage2", "stage3"]


@_on_the_dry_run
def test_dry_run_offload_modes_run_or_say_they_are_missing(dry_run):
    _, doc = dry_run
    parts = doc["pieces"]["offload"]["parts"]
    for name in ("none", "streamed"):
        part = parts[name]
        assert part["search"]["layers"] >= 1 and part["train"]["ms_per_token"] > 0
        assert part["search"]["peak_bytes"] <= part["budget"]["device"]
        assert part["search"]["host_bytes"] <= part["budget"]["host"]
    assert parts["none"]["search"]["host_bytes"] == 0
    assert parts["streamed"]["search"]["host_bytes"] > 0  # pinned_host on CPU too
    for name in ("host_step", "host_step_params"):
        part = parts[name]
        assert "train" in part or part["skipped"].startswith("skipped: mode not available")


@_on_the_dry_run
def test_dry_run_times_the_host_update_by_leaf_count_against_the_triad(dry_run):
    _, doc = dry_run
    rate = doc["pieces"]["host_rate"]
    assert list(rate["update_by_leaves"]) == ["1", "8"]
    assert all(u["bytes_per_s"] > 0 for u in rate["update_by_leaves"].values())
    assert rate["triad"]["threads_bytes_per_s"] > 0 < rate["triad"]["one_thread_bytes_per_s"]
    [found] = rate["targets"]
    best = max(u["bytes_per_s"] for u in rate["update_by_leaves"].values())
    assert found["measured"] == best / rate["triad"]["threads_bytes_per_s"]


@_on_the_dry_run
def test_dry_run_agreement_compiles_for_compile_only_h200s_beside_the_cpu(dry_run):
    _, doc = dry_run
    agreement = doc["pieces"]["agreement"]
    assert agreement["devices"] == 1 and agreement["compile_only_gpu"] == "h200"
    assert list(agreement["stages"]) == ["zero0", "zero3"]  # on a GPU, stages 0-3
    tails = ("", ", autotuning off", ", autotuning loaded")
    assert [t["name"] for t in agreement["targets"]] == [
        f"agreement zero{s} memory{tail}" for s in (0, 3) for tail in tails
    ]
    if importlib.util.find_spec(GPU_PLUGIN) is None:  # no GPU compiler here
        assert all("could not describe" in t["reason"] for t in agreement["targets"])
        return
    assert agreement["compile_only_kind"].startswith("NVIDIA H200")
    for stage in agreement["stages"].values():
        for side in ("device", "device_untuned", "deviceless"):
            assert stage[side]["temp"] > 0 and stage[side]["argument"] > 0, stage
        assert stage["rel_diff"].keys() == {"temp", "argument", "output"}
        assert stage["rel_diff_untuned"].keys() == {"temp", "argument", "output"}
    assert all(t["reason"].startswith("skipped: dry run: CPU memory is not GPU memory")
               for t in agreement["targets"])  # fmt: skip


def test_only_selects_pieces_and_parts_in_order_and_refuses_unknown_names():
    assert catalog.units("offload:host_step,n1") == [("n1", None), ("offload", "host_step")]
    assert catalog.units("agreement") == [("agreement", None)]
    with pytest.raises(ValueError, match="unknown 'offload:host'"):
        catalog.units("offload:host")
    for retired in ("mock8", "mock8:overlap", "table2"):  # compile-only: asserted in CI
        with pytest.raises(ValueError, match="unknown"):
            catalog.units(retired)


def test_quick_runs_every_claim_once_within_one_ten_minute_command():
    units = catalog.units(None, "quick")
    assert units == [("n1", None), ("agreement", None), ("offload_fixed", "none"),
                     ("offload_fixed", "host_step"), ("offload_fixed", "streamed")]  # fmt: skip
    assert sum(catalog.QUICK.values()) <= 10 * 60 - 60  # the machine probe and starts
    with pytest.raises(ValueError, match="--quick runs its own units"):
        catalog.units("n1", "quick")


def test_offload_speed_runs_p20s_gpu_figures_within_one_ten_minute_command():
    units = catalog.units(None, "offload_speed")
    parts = ("none", "host_step", "host_delayed", "streamed", "ratio_half")
    assert units == [*(("offload_32k", p) for p in parts), ("host_rate", None)]
    assert sum(catalog.OFFLOAD_SPEED.values()) <= 10 * 60 - 60
    args = driver.parse_args(["--offload-speed", "--dry-run"])
    assert (args.preset, args.units) == ("offload_speed", units)
    with pytest.raises(SystemExit):
        driver.parse_args(["--offload-speed", "--quick"])


@_on_the_dry_run
def test_dry_run_fixed_offload(dry_run):
    _, doc = dry_run
    fixed = doc["pieces"]["offload_fixed"]["parts"]
    assert fixed["none"]["host_bytes"] == 0 < fixed["host_step"]["host_bytes"]
    assert fixed["none"]["train"]["params"] == fixed["host_step"]["train"]["params"]
    for mode in ("host_step", "streamed"):  # on CPU the replay: the state off the device
        saved = fixed["none"]["compiled_peak_bytes"] - fixed[mode]["compiled_peak_bytes"]
        assert saved >= 0.8 * fixed[mode]["host_bytes_at_rest"] > 0, mode
    link = fixed["streamed"]["link_bytes_per_s"]  # measured (its figure means nothing on CPU)
    assert set(link) == {"down", "up"} and min(link.values()) > 0
    targets = doc["pieces"]["offload_fixed"]["targets"]
    bound = [t for t in targets if t["name"].endswith("bounded by its copies")]
    assert len(bound) == 1 and bound[0]["status"] in ("PASS", "FAIL")


def test_fixed_offload_targets_compare_the_host_step_with_none():
    from gpu_check import offload as gpu_offload

    def mode(peak, ms, compiled=None, at_rest=0):
        return {"allocator_peak_bytes": peak, "compiled_peak_bytes": compiled or peak,
                "host_bytes_at_rest": at_rest,
                "train": {"params": 10**9, "step_ms_median": ms}}  # fmt: skip

    found = {t["name"]: t for t in gpu_offload.fixed_targets(
        {"none": mode(100, 200.0), "host_step": mode(55, 280.0, compiled=60),
         "streamed": mode(60, 300.0, at_rest=50)})}  # fmt: skip
    peak, time = found["offload fixed host_step peak"], found["offload fixed host_step time"]
    assert (peak["status"], peak["measured"]) == ("PASS", 0.55)
    assert (time["status"], time["measured"]) == ("PASS", 1.4)
    streamed = found["offload fixed streamed peak"]  # saved 40 of the 50 it offloads
    assert (streamed["status"], streamed["measured"]) == ("PASS", 0.8)
    agree = found["offload fixed host_step allocator vs compiled"]  # 55 against 60
    assert agree["status"] == "PASS" and agree["measured"] == pytest.approx(55 / 60 - 1)
    found = {t["name"]: t for t in gpu_offload.fixed_targets(
        {"none": mode(100, 200.0), "host_step": mode(99, 620.0, compiled=80),
         "streamed": mode(70, 300.0, at_rest=50)})}  # fmt: skip
    assert found["offload fixed streamed peak"]["status"] == "FAIL"  # 0.6 x its state
    assert found["offload fixed host_step allocator vs compiled"]["status"] == "FAIL"
    assert found["offload fixed host_step peak"]["status"] == "FAIL"
    assert found["offload fixed host_step time"]["status"] == "FAIL"
    found = gpu_offload.fixed_targets({"none": mode(None, 1.0), "host_step": mode(None, 1.0)})
    assert found[0]["reason"] == "skipped: no allocator statistics (CPU)"


def test_at_32k_tokens_each_offloaded_mode_is_held_to_its_share_of_none_s_time():
    from gpu_check import offload as gpu_offload

    run = lambda ms, peak=100: {"train": {"step_ms_median": ms, "tokens_per_step": 32768},
                                "allocator_peak_bytes": peak}  # fmt: skip
    parts = {"none": run(1600.0), "host_step": run(2000.0, 55), "streamed": run(3300.0),
             "host_delayed": run(1700.0, 56), "ratio_half": run(1800.0, 80)}  # fmt: skip
    found = {t["name"]: t for t in gpu_offload.accum_targets(parts)}
    assert found["offload 32k host_step time"]["measured"] == 1.25
    assert found["offload 32k host_step time"]["status"] == "PASS"  # <= 1.3
    assert found["offload 32k host_delayed time"]["status"] == "PASS"  # 1.0625 <= 1.1
    assert found["offload 32k streamed time"]["status"] == "FAIL"  # 2.0625 > 2.0
    assert found["offload 32k ratio_half time between the ends"]["status"] == "PASS"
    assert found["offload 32k ratio_half peak between the ends"]["status"] == "PASS"
    alone = gpu_offload.accum_targets({"none": run(1600.0)})
    assert [t["status"] for t in alone] == ["SKIP"] * 5
    assert alone[0]["reason"] == "skipped: needs offload_32k:none and offload_32k:host_step"


def test_the_streamed_step_is_bounded_by_its_copies_over_the_measured_link():
    from gpu_check import offload as gpu_offload

    none = {"train": {"step_ms_median": 200.0}}
    link = {"down": 50e9, "up": 25e9}  # 10 GB of state: 200 ms down, 400 ms up
    streamed = lambda ms: {"train": {"step_ms_median": ms}, "host_bytes_at_rest": 10**10,
                           "link_bytes_per_s": link}  # fmt: skip
    within = gpu_offload._streamed_bound(none, streamed(800.0))[0]  # bound 200 + 1.1 x 600
    assert (within["status"], within["bound"]) == ("PASS", pytest.approx(860.0))
    assert gpu_offload._streamed_bound(none, streamed(900.0))[0]["status"] == "FAIL"
    missing = gpu_offload._streamed_bound(none, {"skipped": "skipped: not in this build"})
    assert missing[0] == {"name": "offload fixed streamed bounded by its copies",
                          "status": "SKIP", "reason": "skipped: not in this build"}  # fmt: skip


def _mode(params: int, host_bytes: int, ms: float, *, at_none: float | None = None) -> dict:
    part = {
        "budget": {"device": 100, "host": 95, "host_limit": 100 * 10**9},
        "search": {"params": params, "host_bytes": host_bytes},
        "train": {"params": params, "ms_per_token": ms, "layers": 3},
    }
    return part | ({"train_at_none_size": {"ms_per_token": at_none}} if at_none else {})


def test_offload_targets_measure_against_the_pinned_host_limit_and_none_s_time():
    from gpu_check import offload as gpu_offload

    parts = {
        "none": _mode(10**9, 0, 1.0),
        # 12 host bytes per parameter: 100e9 / 12 = 8.33e9 allowed; 8e9 is 0.96 of it
        "host_step": _mode(8 * 10**9, 96 * 10**9, 3.0, at_none=1.5),
        "host_step_params": {"skipped": "skipped: mode not available in this build (x)"},
    }
    found = {t["name"]: t for t in gpu_offload.targets(parts)}
    size, time = found["offload host_step size"], found["offload host_step time"]
    assert (size["status"], size["measured"]) == ("PASS", pytest.approx(0.96))
    assert (time["status"], time["measured"]) == ("PASS", 1.5)
    assert found["offload host_step_params params on host"]["reason"].startswith("skipped: ")
    missing = found["offload host_step_params size"]
    assert missing == {"name": missing["name"], "status": "SKIP", "reason": parts[
        "host_step_params"]["skipped"]}  # fmt: skip
    parts["host_step"] = _mode(6 * 10**9, 72 * 10**9, 3.0, at_none=2.5)
    found = {t["name"]: t for t in gpu_offload.targets(parts)}
    assert found["offload host_step size"]["status"] == "FAIL"  # 0.72 of the allowed size
    assert found["offload host_step time"]["status"] == "FAIL"  # 2.5 x none's
    parts["host_step_params"] = _mode(6 * 10**9, 96 * 10**9, 3.0)  # 16 vs 12 bytes/param
    found = {t["name"]: t for t in gpu_offload.targets(parts)}
    on_host = found["offload host_step_params params on host"]
    assert (on_host["status"], on_host["measured"]) == ("PASS", 4.0)
    del parts["none"], parts["host_step"]["train_at_none_size"]
    found = {t["name"]: t for t in gpu_offload.targets(parts)}
    assert found["offload host_step time"]["reason"].startswith("skipped: needs offload:none")


def test_agreement_compiles_gpu_compile_s_model():
    import gpu_compile  # the programs CI asserts on (test_compiled_for_gpus)
    from gpu_check import agreement as gpu_agreement

    gpu = gpu_agreement.SIZES["gpu"]
    assert gpu_agreement.config(gpu) == gpu_compile.CFG
    assert gpu["sequences"] == gpu_compile.SEQUENCES


def test_agreement_names_the_spec_of_each_lent_gpu():
    from gpu_check import agreement as gpu_agreement

    assert gpu_agreement.spec_name("NVIDIA H200") == "h200"
    assert gpu_agreement.spec_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_agreement.spec_name("NVIDIA H100 PCIe") is None  # another GPU than the spec's


def _agreement(
    monkeypatch,
    *,
    deviceless: dict | None,
    why: str | None = None,
    tuned: dict | None = None,
    results: str | None = "autotune results",
    load_fails: bool = False,
) -> dict:
    """``gpu_agreement.run`` on a GPU, its compiles replaced: the real one's figures are
    100 000 bytes each without autotuning (``tuned`` changes them with it, and it writes
    its autotuning ``results``, None: none), the compile-only GPUs' ``deviceless`` (or no
    such GPUs: ``why``), and with the GPU's results loaded the real tuned figures."""
    import types

    from gpu_check import agreement as gpu_agreement
    from gpu_check.common import Context

    fake = [types.SimpleNamespace(device_kind="NVIDIA H200 141GB HBM3e")]
    real = {"temp": 10**5, "argument": 10**5, "output": 10**5, "alias": 0, "compile_s": 1.0}
    monkeypatch.setattr(gpu_agreement, "spec_name", lambda kind: "h200")
    monkeypatch.setattr(gpu_agreement, "compile_only_devices",
                        lambda name, n: (None, why) if why else (fake, None))  # fmt: skip

    def memory(devices, s, stage, options=None):
        options = options or {}
        if devices is not fake:
            if gpu_agreement.DUMP_TUNING in options and results is not None:
                pathlib.Path(options[gpu_agreement.DUMP_TUNING]).write_text(results)
            return real if options == gpu_agreement.UNTUNED else real | (tuned or {})
        if deviceless is None:
            raise RuntimeError("Couldn't find ptxas\nmore")
        if gpu_agreement.LOAD_TUNING in options:
            if load_fails:
                raise RuntimeError("NOT_FOUND: autotuning result not found\nmore")
            assert pathlib.Path(options[gpu_agreement.LOAD_TUNING]).read_text() == results
            return real | (tuned or {})
        return real | deviceless

    monkeypatch.setattr(gpu_agreement, "memory", memory)
    return gpu_agreement.run(Context(dry_run=False, gpu=True))


def _named(found: dict) -> dict[str, dict]:
    return {t["name"]: t for t in found["targets"]}


def test_agreement_holds_each_memory_figure_within_one_percent(monkeypatch):
    found = _agreement(monkeypatch, deviceless={"temp": 100_900, "output": 99_500})
    assert [t["status"] for t in found["targets"]] == ["PASS"] * 12  # 3 per stage
    assert found["targets"][0]["measured"] == pytest.approx(0.009)
    assert found["stages"]["zero3"]["rel_diff"] == pytest.approx(
        {"temp": 0.009, "argument": 0.0, "output": 0.005}
    )
    found = _agreement(monkeypatch, deviceless={"argument": 102_000})
    t = _named(found)["agreement zero1 memory"]
    assert (t["status"], t["measured"], t["bound"]) == ("FAIL", pytest.approx(0.02), 0.01)
    assert "compile agreement within 1%" in t["text"]


def test_agreement_reads_the_real_compile_with_and_without_autotuning(monkeypatch):
    # As on the H200: autotuned gemms add a cuBLAS workspace the compile-only GPUs cannot
    # know, unless the GPU's autotuning results are loaded into their compile.
    found = _agreement(monkeypatch, deviceless={}, tuned={"temp": 108_000})
    assert [t["name"] for t in found["targets"][:3]] == [
        "agreement zero0 memory",
        "agreement zero0 memory, autotuning off",
        "agreement zero0 memory, autotuning loaded",
    ]
    assert [t["status"] for t in found["targets"]] == ["FAIL", "PASS", "PASS"] * 4
    assert found["targets"][0]["measured"] == pytest.approx(8_000 / 108_000)
    assert found["targets"][1]["measured"] == found["targets"][2]["measured"] == 0.0
    assert "(autotuning off)" in found["targets"][1]["text"]
    zero2 = found["stages"]["zero2"]
    assert zero2["device"]["temp"] == zero2["deviceless_tuned"]["temp"] == 108_000
    assert zero2["device_untuned"]["temp"] == zero2["deviceless"]["temp"] == 100_000
    assert zero2["autotune_results"] == "autotune results"  # kept for compiles without GPUs


def test_agreement_skips_the_loaded_target_when_the_gpu_wrote_no_results(monkeypatch):
    found = _agreement(monkeypatch, deviceless={}, results=None)
    t = _named(found)["agreement zero3 memory, autotuning loaded"]
    assert (t["status"], t["reason"]) == (
        "SKIP",
        "skipped: no autotuning results loaded: the real compile wrote none",
    )
    assert "deviceless_tuned" not in found["stages"]["zero3"]
    found = _agreement(monkeypatch, deviceless={}, load_fails=True)  # the others still run
    assert [t["status"] for t in found["targets"]] == ["PASS", "PASS", "SKIP"] * 4
    assert _named(found)["agreement zero3 memory, autotuning loaded"]["reason"] == (
        "skipped: no autotuning results loaded: its compile failed "
        "(RuntimeError: NOT_FOUND: autotuning result not found)"
    )


def test_agreement_skips_with_the_reason_when_no_compile_only_gpu_is_there(monkeypatch):
    found = _agreement(monkeypatch, deviceless=None, why="NotImplementedError: no cuda")
    (reason,) = {t["reason"] for t in found["targets"]}
    assert reason.startswith("skipped: could not describe ")  # N compile-only h200 GPU(s)
    assert reason.endswith(" here (NotImplementedError: no cuda)")
    assert found["stages"]["zero0"]["device"]["temp"] == 10**5  # the real compile's, kept
    found = _agreement(monkeypatch, deviceless=None)  # described, but its compile failed
    (reason,) = {t["reason"] for t in found["targets"]}
    assert reason == ("skipped: the compile for compile-only GPUs failed here "
                      "(RuntimeError: Couldn't find ptxas)")  # fmt: skip
    assert found["stages"]["zero3"]["deviceless_error"] == "RuntimeError: Couldn't find ptxas"


def test_a_dry_run_refuses_to_overwrite_gpu_results(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"dry_run": False, "pieces": {"n1": {"targets": []}}}))
    with pytest.raises(ValueError, match="holds GPU results"):
        driver._load(path, dry_run=True)
    assert driver._load(path, dry_run=False)["pieces"] == {"n1": {"targets": []}}


def test_a_part_that_times_out_reports_what_it_had_written(monkeypatch):
    def timeout(cmd, **kw):
        out, err = b"probe done\n", b"compiling zero3\n"
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=out, stderr=err)

    monkeypatch.setattr(driver.subprocess, "run", timeout)
    args = driver.argparse.Namespace(dry_run=False)
    error = driver._process(args, "agreement", REPO / "x.json", env={}, gpus=1, seconds=5)
    assert error.startswith("timed out after 5 s: run it alone (--only agreement)"), error
    assert error.endswith("it had written:\ncompiling zero3\nprobe done\n"), error
