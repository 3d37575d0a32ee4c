"""The documentation's benchmark tables and plots, generated from the committed JSON.

Nothing measured is typed into the docs: every figure on the benchmark page (and the
tables the guides include) is written here from ``benchmarks/*.json``, which
``scripts/bench.py``, ``scripts/accuracy.py``, ``scripts/frozen_peer_trials.py`` and
``scripts/table2_gpu.py`` (its own verdicts, ``target_met``) write.
The PASS/FAIL lines are the scripts' own checks (``benchmark.targets.checks``, ``max_model_table``)
run on the committed numbers.

    python scripts/figures.py                      # into docs/_generated (as docs/conf.py does)
    python scripts/figures.py --out /tmp/figs
    python scripts/figures.py --headline docs/figures/stages_cpu8.png   # the README's figure
    python scripts/figures.py --readme README.md   # the README's GPU paragraph

Every PNG carries the sha256 of the JSON it was drawn from in a ``Source`` text chunk
(:func:`source_tag`), so a test can tell a committed figure that is out of date.
Optional inputs (``accuracy_cpu8.json``, ``frozen_peer_trials.json``) are skipped when
absent, and their fragments say so.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MAIN_JOB = ROOT / "examples" / "results" / "main_job_cpu8"  # .json and .png, if committed
STAGE_RUNS = ("dp", "zero1", "zero2", "zero3", "auto_fsdp")


def _load_script(name: str) -> Any:
    """``scripts/<name>.py`` as a module, or (a dotted name) a module of a package under
    ``scripts/`` (their checks and tables are the source of truth). Their imports
    (``examples/gpt.py``, ``scripts/max_model.py``) are found as ``scripts/bench.py``
    finds them."""
    for folder in (ROOT / "examples", ROOT / "scripts"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    if "." in name:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_tag(path: Path) -> str:
    """What a figure was drawn from: the JSON's name and the sha256 of its bytes."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"{path.relative_to(ROOT).as_posix()} sha256={digest}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def _md_table(rows: list[tuple[str, ...]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _heading(bench: dict[str, Any]) -> str:
    m, s = bench["model"], bench["settings"]
    return (
        f"`{m['name']}`: {m['params']:,} parameters ({m['dtype']}), {s['optimizer']}, "
        f"global batch {s['batch']} of {s['seq_len']} tokens, on {bench['devices']} "
        f"{bench['platform']} devices, jax {bench['jax']}; median of {s['steps']} steps "
        f"after {s['warmup']} warm-up steps."
    )


def _run_row(r: dict[str, Any]) -> tuple[str, ...]:
    comm = r["comm_bytes_per_device"]
    return (
        f"`{r['name']}`",
        _mb(r["model_state_bytes_per_device"]),
        _mb(r["theory_model_state_bytes_per_device"]),
        _mb(r["host_bytes_per_device"]),
        _mb(r["peak_bytes_per_device"]),
        _mb(r["device_peak_bytes_per_device"]),
        _mb(comm["total"]),
        _mb(r["theory_comm_bytes_per_device"]),
        _mb(comm["all-gather"]),
        str(r["collectives_per_step"]),
        f"{r['step_ms_median']:.0f}",
        f"{r['loss_last']:.6f}",
    )


RUN_HEAD = (
    "run", "states MB", "theory", "host MB", "XLA peak MB", "device peak MB", "comm MB",
    "theory", "gather MB", "colls", "ms", "final loss",
)  # fmt: skip


RUN_KEY = (
    "Per device, MB = 1e6 bytes: model states (params, gradients, optimizer state) and "
    "their theory, of which in host memory; compiled peak as XLA:CPU's memory analysis "
    "counts it (one memory) and in device memory alone (the schedule replayed by memory "
    "space); bytes sent per step (ring "
    "model) and their theory, of which all-gathers; collectives per step; median step "
    "time in ms; final loss."
)


def bench_runs_md(bench: dict[str, Any], names: tuple[str, ...] | None = None) -> str:
    """The benchmark's runs (all, or ``names``) as a Markdown table, then its key."""
    runs = [r for r in bench["runs"] if names is None or r["name"] in names]
    return _md_table([RUN_HEAD, *[_run_row(r) for r in runs]]) + "\n\n" + RUN_KEY


def _stage3_runs(bench: dict[str, Any]) -> tuple[str, ...]:
    """Stage 3 and its variants (``zero3_*``): whatever runs the JSON holds."""
    return tuple(r["name"] for r in bench["runs"] if r["name"].split("_")[0] == "zero3")


def bench_ratios_md(bench: dict[str, Any]) -> str:
    """The ratios the guides quote, computed from the runs (absent runs are left out)."""
    runs = {r["name"]: r for r in bench["runs"]}
    lines = []

    def ratio(a: str, b: str, key: str) -> float | None:
        if a in runs and b in runs and runs[b][key]:
            return runs[a][key] / runs[b][key]
        return None

    def comm(name: str) -> float:
        return runs[name]["comm_bytes_per_device"]["total"]

    if (p := ratio("zero3", "dp", "peak_bytes_per_device")) is not None:
        lines.append(f"stage 3's compiled peak is {p:.3f} x stage 0's")
    if "auto_fsdp" in runs:
        theory = lambda name: runs[name]["theory_comm_bytes_per_device"]
        lines.append(
            f"plain `jit` (`auto_fsdp`) moves {comm('auto_fsdp') / theory('auto_fsdp'):.2f} x"
            f" the ring-model bytes; jzero's stage 3 moves {comm('zero3') / theory('zero3'):.4f} x"
        )
    if "zero3_bucket" in runs:
        z, b = runs["zero3"], runs["zero3_bucket"]
        lines.append(
            f"`bucket=True`: {b['collectives_per_step']} collectives per step instead of "
            f"{z['collectives_per_step']}, at {b['step_ms_median'] / z['step_ms_median']:.2f} x"
            " stage 3's step time"
        )
    for name, what in (("zero3_int8", "all-gather"), ("zero3_qgz", None)):
        if name in runs:
            r, z = runs[name], runs["zero3"]
            if what:
                part = r["comm_bytes_per_device"][what] / z["comm_bytes_per_device"][what]
                text = f"all-gather bytes {part:.3f} x stage 3's"
            else:
                a2a = sum(r["all_to_all_bytes_by_dtype"].values())
                part = a2a / z["comm_bytes_per_device"]["reduce-scatter"]
                text = f"gradient bytes {part:.3f} x stage 3's reduce-scatters"
            lines.append(
                f"`{name}`: {text}; step time {r['step_ms_median'] / z['step_ms_median']:.2f} x;"
                f" final loss {abs(r['loss_last'] / z['loss_last'] - 1):.1e} relative from "
                "stage 3's"
            )
    if "zero3_offload" in runs:
        r, z = runs["zero3_offload"], runs["zero3"]
        lines.append(
            f"`zero3_offload`: {_mb(r['host_bytes_per_device'])} MB per device in pinned host "
            f"memory, step time {r['step_ms_median'] / z['step_ms_median']:.2f} x stage 3's, "
            f"final loss {'equal to' if r['loss_last'] == z['loss_last'] else 'unlike'} "
            "stage 3's"
        )
    return "\n".join(f"- {line}." for line in lines)


def user_step_md(bench: dict[str, Any]) -> str:
    """Per stage, jzero's own step (``zeroN``) beside the user's own ``jit`` step with
    ``jzero.shard_optimizer`` (``user_zeroN``), where the JSON holds both."""
    runs = {r["name"]: r for r in bench["runs"]}
    head = ("stage", "step", "ms/step", "peak MB", "sent MB", "all-gather MB", "collectives",
            "final loss")  # fmt: skip
    rows = [head]
    for stage in (1, 2, 3):
        for name, what in ((f"zero{stage}", "jzero's"), (f"user_zero{stage}", "your jit")):
            if name in runs:
                r = runs[name]
                comm = r["comm_bytes_per_device"]
                rows.append((
                    str(stage), what, f"{r['step_ms_median']:.1f}",
                    _mb(r["peak_bytes_per_device"]), _mb(comm["total"]),
                    _mb(comm["all-gather"]), str(r["collectives_per_step"]),
                    f"{r['loss_last']:.6f}",
                ))  # fmt: skip
    if len(rows) == 1:
        return "The benchmark JSON holds no user-step runs (`user_zero1`-`user_zero3`)."
    key = (
        "Per device, MB = 1e6 bytes: compiled peak (XLA:CPU's memory analysis), bytes sent "
        "per step (ring model) and the all-gathers' share, collectives per step, median "
        "step time. `your jit`: `jzero.shard_optimizer` in a plain `jax.jit` step, the "
        "example GPT's blocks gathering with `jzero.gather(..., mesh=)`."
    )
    return _md_table(rows) + "\n\n" + key


def bench_targets_md(bench: dict[str, Any]) -> str:
    """``scripts/bench.py``'s own PASS/FAIL checks, run on the committed numbers."""
    checks = _load_script("benchmark.targets").checks(bench)
    return "```text\n" + "\n".join(checks) + "\n```"


def checkpoint_md(ck: dict[str, Any]) -> str:
    """Checkpoint throughput (``bench_cpu8.json``'s ``checkpoint`` object)."""
    m, other = ck["model"], ck["restore_other"]
    what = {
        "save_blocking": "`save` returns (asynchronous: arrays off the devices)",
        "save_total": "`save` on disk (`wait()` returns)",
        "restore_same": f"`restore` into the same layout (stage {ck['stage']})",
        "restore_other": f"`restore` into stage {other['stage']} on {other['devices']} devices",
        "export": "`export_safetensors` (the parameters)",
    }
    rows = [("operation", "seconds (median)", "MB/s", "first call (compiles), s")]
    for op, text in what.items():
        o = ck["ops"][op]
        rows.append(
            (text, f"{o['seconds']:.2f}", f"{o['mb_per_s']:,.0f}", f"{o['seconds_cold']:.2f}")
        )
    head = (
        f"`{m['name']}`: {m['params']:,} parameters ({m['dtype']}) + {ck['optimizer']} "
        f"state, stage {ck['stage']} on {ck['devices']} devices: "
        f"{ck['state_bytes'] / 1e6:,.1f} MB of state, median of {ck['reps']} repetitions."
    )
    return head + "\n\n" + _md_table(rows)


def max_model_md(mm_json: dict[str, Any]) -> str:
    """The largest model per budget (ZeRO's Table 2, measured by compiling)."""
    mm = mm_json["max_model"]
    fam = mm["family"]
    head = (
        f"`examples/gpt.py` at width {fam['d_model']} ({fam['n_heads']} heads, "
        f"{fam['seq_len']} positions, vocabulary {fam['vocab']}, {fam['dtype']}, global batch "
        f"{fam['batch']}), depth varied: the most layers whose compiled step fits "
        f"{mm['budget']} per device on {mm['devices']} {mm_json['platform']} devices."
    )
    rows = [(
        "run", "layers", "parameters", "device peak MB", "host peak MB", "XLA:CPU peak MB",
        "estimate", "estimate error",
    )]  # fmt: skip
    for s in mm["stages"]:
        rows.append((
            f"`{s['name']}`", str(s["layers"]), f"{s['params']:,}", _mb(s["peak_bytes"]),
            _mb(s["host_bytes"]), _mb(s["xla_peak_bytes"]), f"{s['estimate_params']:,}",
            f"{100 * s['estimate_error']:+.1f} %",
        ))  # fmt: skip
    table = _load_script("max_model").max_model_table(mm, platform=mm_json["platform"])
    verdicts = [line for line in table.splitlines() if line.startswith(("PASS", "FAIL"))]
    body = head + "\n\n" + _md_table(rows)
    return body + ("\n\n```text\n" + "\n".join(verdicts) + "\n```" if verdicts else "")


def table2_gpu_md(t2: dict[str, Any] | None) -> str:
    """The ZeRO paper's Table 2 compiled for GPUs (``scripts/table2_gpu.py``): per target
    and stage the largest model that fits, beside the paper's figures for 64 V100s, and
    the targets' verdicts; or a note when the JSON is absent."""
    if t2 is None:
        return (
            "No `benchmarks/table2_gpu.json` is committed yet: `JAX_PLATFORMS=cpu python "
            "scripts/table2_gpu.py --out benchmarks/table2_gpu.json` writes it."
        )
    m = t2["model"]
    head = (
        f"`examples/gpt.py` (sequence {m['seq_len']}, vocabulary {m['vocab']}, one sequence "
        f"per GPU, {m['optimizer']}, {m['train_step']}), compiled by jax {t2['jax']}'s XLA:GPU "
        f"for compile-only GPUs. Per device: {t2['memory_formula']}; fits: at most "
        f"{t2['budget_fraction']:g} x the spec's `device_memory_size`. GB = 1e9 bytes, "
        "B = 1e9 parameters; states bound: the budget / the paper's model-state bytes a "
        "parameter (16, divided by N as the stage shards them); the paper's figures are "
        "for 64 V100-32GB at the full 32 GB."
    )
    rows = [(
        "GPUs", "dtype", "stage", "width x layers", "B params", "GB per GPU",
        "one layer more, GB", "budget GB", "states bound", "paper: theory", "paper: measured",
    )]  # fmt: skip
    verdicts = []
    for t in t2["targets"]:
        gpus = f"{t['devices']} x {t['device_kind']}"
        for s in t["stages"]:
            paper = s.get("paper", {})
            rows.append((
                gpus, t["precision"].split()[0], str(s["stage"]), f"{s['width']} x {s['layers']}",
                f"{s['params'] / 1e9:,.2f}", f"{s['bytes']['total'] / 1e9:,.2f}",
                f"{s['next']['bytes']['total'] / 1e9:,.2f}", f"{t['budget_bytes'] / 1e9:,.2f}",
                f"{s['theory_params'] / 1e9:,.1f} B",
                f"{paper['theory'] / 1e9:g} B" if paper.get("theory") else "",
                f"{paper['measured'] / 1e9:g} B" if paper.get("measured") else "",
            ))  # fmt: skip
            if "target_params" in s:
                verdicts.append(
                    f"{'PASS' if s['target_met'] else 'FAIL'} {t['name']} stage {s['stage']}: "
                    f"{s['params'] / 1e9:.2f} B >= {s['target_params'] / 1e9:g} B"
                )
    body = head + "\n\n" + _md_table(rows)
    took = f"The search took {t2['wall_seconds'] / 60:.0f} minutes on 2 CPU cores"
    partial = " (stopped early: the stages found so far)" if t2.get("partial") else ""
    body += f"\n\n{took}{partial}."
    return body + ("\n\n```text\n" + "\n".join(verdicts) + "\n```" if verdicts else "")


def gpu_plans_md(plans: dict[str, Any] | None) -> str:
    """The plans for GPUs that are not here (``scripts/plan_gpu.py``): per plan its target,
    the chosen configuration, its compiled peak against the budget, the next-larger
    micro-batch's, the collective bytes, the compiles and the time and host memory taken."""
    if plans is None:
        return (
            "No `benchmarks/gpu_plans.json` is committed yet: `JAX_PLATFORMS=cpu python "
            "scripts/plan_gpu.py --out benchmarks/gpu_plans.json` writes it."
        )
    gb = lambda b: "-" if b is None else f"{b / 1e9:,.2f}"
    rows = [
        (
            "plan",
            "model",
            "GPUs",
            "chosen",
            "per GPU at a time",
            "peak GB",
            "budget GB",
            "next-larger micro-batch GB",
            "sent per GPU per step GB",
            "compiled",
            "minutes",
            "host peak GB",
        )
    ]
    for p in plans["plans"]:
        model = f"{p['params'] / 1e9:.2f} B"
        if p["kind"] == "user_step":
            rows.append(
                (
                    f"`{p['name']}`",
                    model,
                    p["target"],
                    "own jit step, stage 3",
                    f"{p['micro_batch']} x {p['seq_len']}",
                    gb(p["device_bytes"]),
                    "",
                    "",
                    gb(p["collective_bytes"]),
                    "1",
                    f"{p['wall_seconds'] / 60:.1f}",
                    gb(p["peak_rss_bytes"]),
                )
            )
            continue
        s = p["search"]
        chosen = next(r for r in s["rows"] if r["name"] == s["chosen"])
        larger = s["larger"] or {}
        rows.append(
            (
                f"`{p['name']}`",
                model,
                p["target"],
                f"`{chosen['name']}`",
                f"{chosen['micro_batch']} x {p['seq_len']}",
                gb(chosen["device_bytes"]),
                gb(s["device_budget"]),
                gb(larger.get("device_bytes")),
                gb(chosen["collective_bytes"]),
                str(s["compiled"]),
                f"{p['wall_seconds'] / 60:.1f}",
                gb(p["peak_rss_bytes"]),
            )
        )
    head = (
        f"{plans['model']}; compiled by jax {plans['jax']}'s XLA:GPU for compile-only "
        "GPUs on 2 CPU cores, each plan in a process of its own. GB = 1e9 bytes; peak: "
        "the compiled step's device memory per GPU; host peak: the planning process's "
        "resident memory."
    )
    return head + "\n\n" + _md_table(rows)


def gpu_compile_md(gc: dict[str, Any] | None) -> str:
    """The example GPT's steps compiled for compile-only H200s (``scripts/gpu_compile.py``):
    per program its temporaries, elements sent against the paper's volume, what it
    all-reduces and whether its in-loop all-gathers overlap compute."""
    if gc is None:
        return (
            "No `benchmarks/gpu_compile_h200.json` is committed yet: `python "
            "scripts/gpu_compile.py --out benchmarks/gpu_compile_h200.json` writes it."
        )
    m = gc["model"]
    head = (
        f"`examples/gpt.py` (d_model {m['d_model']}, {m['n_layers']} scanned layers, bf16 "
        f"compute, fp32 parameters, AdamW; {gc['sequences']} x {m['seq_len']} tokens, "
        f"{gc['parameters']:,} parameters), compiled by jax {gc['jax']}'s XLA:GPU for "
        "compile-only H200s. Elements sent: per device per step in the ring model, over "
        "the paper's 2Ψ(N−1)/N (stages 0-2) or 3Ψ(N−1)/N (stage 3). The stack's fp32 "
        f"gradient: {_mb(gc['stack_grad_bytes_fp32'])} MB. Layer arrays loops carry: "
        "arrays of a layer's weight shape in the while loops' state: the full gradients "
        "XLA's reduce-scatter pipeliner carries into the next step (`zero3_pipelined`: "
        "`Communication(pipeline_scatter=True)`), or the next layer's gathered weights "
        "(`zero3_prefetch`)."
    )
    rows = [("program", "GPUs", "temp MB", "elements / paper", "all-reduced elements",
             "in-loop all-gathers overlapped", "layer arrays loops carry",
             "compile s")]  # fmt: skip
    for name, r in gc["runs"].items():
        gpus = "64" if name.endswith("_64") else "8"
        looped = r["in_loop_all_gathers"]
        rows.append((
            name, gpus, _mb(r["temp_bytes"]), f"{r['elements_over_theory']:.3f}",
            f"{r['all_reduced_elements']:,}",
            f"{r['in_loop_all_gathers_overlapped']} of {looped}" if looped else "",
            str(r["loop_carried_layer_arrays"]), f"{r['compile_s']:.0f}",
        ))  # fmt: skip
    return head + "\n\n" + _md_table(rows)


def _against(r: dict[str, Any] | None, dp: dict[str, Any] | None) -> str:
    """A run's first step in seconds, and its ratio to plain jit's."""
    if r is None:
        return ""
    ratio = f" ({r['first_s'] / dp['first_s']:.1f}x)" if dp and r is not dp else ""
    return f"{r['first_s']:.1f} s{ratio}"


def compile_time_md(runs: list[dict[str, Any] | None]) -> str:
    """Time to the first step per run and size (``scripts/compile_time.py``): on XLA:CPU
    (trace, compile and run) and in the GPU compile (trace and compile), each beside
    plain jit's."""
    parts = []
    for ct in runs:
        if ct is None:
            continue
        names = list(dict.fromkeys(r["run"] for r in ct["runs"]))
        by = {(r["leaves"], r["run"]): r for r in ct["runs"]}
        rows = [("leaves", *names)]
        for leaves in sorted({r["leaves"] for r in ct["runs"]}):
            dp = by.get((leaves, "dp"))
            cells = [_against(by.get((leaves, n)), dp) for n in names]
            rows.append((str(leaves), *cells))
        parts.append(f"{ct['platform']}, {ct['devices']} devices, jax {ct['jax']}, "
                     f"{ct['cores']} cores:\n\n" + _md_table(rows))  # fmt: skip
    return "\n\n".join(parts) or "No compile-time JSON is committed yet."


def matrices_md(mat: dict[str, Any] | None) -> str:
    """Muon against AdamW on the example GPT (``bench.py --matrices``), after and before
    jzero updated matrix optimizers on whole matrices: Muon's ratios to AdamW's bytes,
    peak and step time, and its Newton-Schulz FLOPs per device over 1/N of the total."""
    if mat is None:
        return "No matrix-optimizer JSON is committed yet."
    earlier = mat.get("before", {}).get("matrices", [])
    before = {(r["model"], r["api"], r["stage"]): r for r in earlier}
    rows = [("model", "step", "stage", "bytes x AdamW", "peak x AdamW", "NS FLOPs x 1/N",
             "time x AdamW")]  # fmt: skip
    keys = ("comm_ratio", "peak_ratio", "newton_schulz_share", "step_time_ratio")
    for r in mat["matrices"]:
        b = before.get((r["model"], r["api"], r["stage"]))
        cells = [(f"{b[k]:.2f} -> " if b else "") + f"{r[k]:.2f}" for k in keys]
        api = "jzero's" if r["api"] == "zero" else "user's"
        rows.append((r["model"], api, str(r["stage"]), *cells))
    head = f"{mat['model']['name']}, {mat['platform']} x {mat['devices']}, jax {mat['jax']}"
    return f"{head}; before -> after:\n\n{_md_table(rows)}\n\n{mat.get('note', '')}".rstrip()


def accuracy_md(acc: dict[str, Any] | None) -> str:
    """Final-loss differences over seeds (``scripts/accuracy.py``), or a note when absent."""
    if acc is None:
        return (
            "No `benchmarks/accuracy_cpu8.json` is committed yet: "
            "`python scripts/accuracy.py --json benchmarks/accuracy_cpu8.json` writes it."
        )
    s, m = acc["settings"], acc["model"]
    head = (
        f"`{m['name']}` ({m['params']:,} parameters), stage {s['stage']} on {acc['devices']} "
        f"{acc['platform']} devices ({acc['cpu']}), jax {acc['jax']}; "
        f"{s.get('optimizer_text', s.get('optimizer'))}, global batch {s['batch']}, "
        f"{s['steps']} steps, seeds {s['seeds'][0]}-{s['seeds'][-1]}; a run's final loss is "
        f"the {s.get('final', 'last training loss')}. Each variant relative to the exact run "
        "of the same seed, `(variant - exact) / exact`:"
    )
    rows = [("variant", "mean", "std", "min", "max", "curves equal to exact")]
    for v in acc["variants"]:
        rows.append((
            f"`{v['name']}`", f"{v['rel_diff_mean']:+.2e}", f"{v['rel_diff_std']:.2e}",
            f"{v['rel_diff_min']:+.2e}", f"{v['rel_diff_max']:+.2e}",
            f"{v['curves_equal_exact']} / {len(v['rel_diff'])}",
        ))  # fmt: skip
    return head + "\n\n" + _md_table(rows)


def autoconfig_md(ac: dict[str, Any] | None) -> str:
    """``scripts/autoconfig_bench.py``'s runs: per model and budget, the choice, the three
    fastest-predicted candidates measured side by side, and the checks; or a note."""
    if ac is None:
        return (
            "No `benchmarks/autoconfig_cpu8.json` is committed yet: "
            "`python scripts/autoconfig_bench.py --json benchmarks/autoconfig_cpu8.json` "
            "writes it."
        )
    m = ac["device_model"]
    head = (
        f"{ac['devices']} {ac['platform']} devices, jax {ac['jax']}; device model "
        f"F = {m['flops_per_s'] / 1e9:.1f} GFLOP/s, B = {m['collective_bytes_per_s'] / 1e9:.2f} "
        f"GB/s; median of {ac['steps']} steps per candidate; {ac['seconds'] / 60:.0f} min "
        "in all."
    )
    rows = [("model", "budget MB", "chosen", "peak MB", "search s", "top three: predicted / "
             "measured ms", "fits", "fastest", "order")]  # fmt: skip
    for r in ac["runs"]:
        s, c = r["search"], r["checks"]
        chosen = next(x for x in s["rows"] if x["name"] == s["chosen"] and x["dropped"] is None)
        top = "; ".join(
            f"{x['name']}: {x['predicted_s'] * 1e3:.1f} / {x['measured_s'] * 1e3:.1f}"
            for x in r["top3"]
        )
        mark = lambda ok: "yes" if ok else "**no**"
        rows.append((
            f"{r['size']} (d {r['model']['d_model']}, {r['model']['n_layers']} layers)",
            f"{s['device_budget'] / 1e6:,.1f}", f"`{s['chosen']}`",
            f"{chosen['device_bytes'] / 1e6:,.2f}", f"{s['search_seconds']:.0f}", top,
            mark(c["fits"]), mark(c["fastest"]), mark(c["order"]),
        ))  # fmt: skip
    return head + "\n\n" + _md_table(rows)


def frozen_peer_md(fp: dict[str, Any] | None) -> str:
    """Who speaks first when a peer freezes (``scripts/frozen_peer_trials.py``)."""
    if fp is None:
        return (
            "No `benchmarks/frozen_peer_trials.json` is committed yet: "
            "`python scripts/frozen_peer_trials.py --json benchmarks/frozen_peer_trials.json` "
            "writes it."
        )
    s = fp["summary"]
    msg, out = s["seconds_to_message"], s["seconds_to_exit"]
    rows = [
        ("trials", str(s["trials"])),
        ("jzero's message came first", f"{s['trials'] - s['lost_races']} / {s['trials']}"),
        ("the survivor named the frozen process", f"{s['named_the_frozen_process']}"),
        ("seconds from the freeze to the message (min / median / max)",
         " / ".join(f"{x:.1f}" if x is not None else "-" for x in msg.values())),
        ("seconds from the freeze to the survivor's exit (min / median / max)",
         " / ".join(f"{x:.1f}" if x is not None else "-" for x in out.values())),
        ("resumed process said it had been stopped", str(s["resumed_said_it_was_stopped"])),
    ]  # fmt: skip
    head = (
        f"`initialize(timeout={fp['timeout']:g})`, watchdog {fp['watchdog']:g} s, JAX's "
        f"earliest heartbeat abort {fp['earliest_jax_abort_s']:g} s, jax {fp['jax']}."
    )
    return head + "\n\n" + _md_table([("over the trials", "result"), *rows])


def main_job_md(mj: dict[str, Any] | None, figure: str | None) -> str:
    """The main job's run (``examples/train_lm.py``, ``bash scripts/main.sh``): its model,
    losses, speed and sample, from ``examples/results/main_job_cpu8.json``."""
    if mj is None:
        return (
            "No `examples/results/main_job_cpu8.json` is committed yet: "
            "`bash scripts/main.sh` trains the main job and `examples/README.md` says how "
            "its results are recorded."
        )
    m, flags = mj["model"], mj.get("flags", {})
    procs = f"{mj['processes']} process" + ("" if mj["processes"] == 1 else "es")
    head = (
        f"`examples/train_lm.py` at stage {mj['stage']} on {mj['devices']} {mj['platform']} "
        f"devices ({procs}): a GPT of {m['layers']} layers, width "
        f"{m['d_model']}, {m['heads']} heads, {m['seq_len']} positions ({mj['params']:,} "
        f"parameters, {m['dtype']}), {mj['steps']} steps of {mj['batch_size']} sequences "
        f"({mj['tokens_per_step']:,} tokens), learning rate {flags.get('lr')}; "
        f"{mj['train_bytes']:,} bytes of text to train on, {mj['val_bytes']:,} held out."
    )
    first, last = mj["train_loss_first"], mj["train_loss_last"]
    rows = [
        ("measured", "value"),
        ("training loss (nats per byte), first -> last", f"{first:.3f} -> {last:.3f}"),
        ("held-out loss, final (lowest, at step)",
         f"{mj['val_loss_final']:.3f} ({mj['val_loss_min']:.3f}, {mj['val_loss_min_step']})"),
        ("tokens per second", f"{mj['tokens_per_s']:,.0f}"),
        ("wall time, s", f"{mj['wall_s']:,.0f}"),
    ]  # fmt: skip
    sample = mj.get("sample", {})
    text = [head, "", _md_table(rows)]
    if sample:
        text += [
            "",
            f"A sample at temperature {sample['temperature']} from the prompt "
            f'"{sample["prompt"]}":',
            "",
            "```text",
            sample["text"],
            "```",
        ]
    if figure:
        text += ["", f"![The main job's training and held-out loss]({figure})"]
    return "\n".join(text)


def _gpu_offload(gpu: dict[str, Any] | None) -> dict[str, Any] | None:
    """The GPU check's offload runs at a fixed size (``offload_fixed``), if it measured any."""
    parts = ((gpu or {}).get("pieces", {}).get("offload_fixed") or {}).get("parts") or {}
    runs = {k: v for k, v in parts.items() if isinstance(v, dict) and "train" in v}
    return runs if "none" in runs else None


def offload_md(off: dict[str, Any] | None, gpu: dict[str, Any] | None) -> str:
    """The offload benchmark (``benchmarks/offload_cpu8.json``): the host update's rate
    against the triad, and each mode's step and peaks; then what the lent GPU measured
    (``benchmarks/gpu_check.json``)."""
    if off is None:
        return "*No offload benchmark committed: `python scripts/offload_bench.py --json ...`.*"
    tri, upd = off["triad"], off["host_update"]
    ok = "meets" if upd["over_triad"] >= upd["target"] else "misses"
    text = [
        f"On {off['devices']} {off['platform']} devices ({off['cpu_threads']} threads, jax "
        f"{off['jax']}): the host update of {upd['params']:,} AdamW parameters (bf16, fp32 "
        f"master) moves {upd['bytes_per_s'] / 1e9:.1f} GB/s, {upd['over_triad']:.2f} x the "
        f"{tri['threads']}-thread STREAM triad's {tri['threads_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(one thread: {tri['one_thread_bytes_per_s'] / 1e9:.1f} GB/s); it {ok} the "
        f"{upd['target']} x target. The same update on the device: "
        f"{upd['device']['bytes_per_s'] / 1e9:.1f} GB/s.",
        "",
        f"{off['model']['name']} ({off['model']['params'] / 1e6:.2f}M params, stage 3, "
        f"{off['model']['precision']}):",
        "",
    ]
    none = next(r for r in off["modes"] if r["name"] == "none")
    rows = [("mode", "step (ms)", "x none", "device peak (MB)", "host at rest (MB)",
             "state on host")]  # fmt: skip
    for r in off["modes"]:
        rows.append((
            f"`{r['name']}`", f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_median'] / none['step_ms_median']:.2f}",
            f"{r['device_peak_bytes'] / 1e6:.3f}", f"{r['host_bytes_at_rest'] / 1e6:.3f}",
            f"{r['host_share_of_state']:.2f}",
        ))  # fmt: skip
    return "\n".join(text) + "\n" + _md_table(rows) + "\n\n" + _gpu_offload_md(gpu)


def _gpu_offload_md(gpu: dict[str, Any] | None) -> str:
    runs = _gpu_offload(gpu)
    if runs is None:
        return "*No GPU has measured offload yet.*"
    m, none = gpu["machine"], runs["none"]["train"]
    first = min(r["ran_at"] for r in runs.values())[:10]
    t = runs["none"]
    text = (
        f"On the lent {m['device_kind']} ({m['devices']} device, {m['cpu_count']} host "
        f"cores, jax {m['jax']}, {first}), the {t['train']['params'] / 1e9:.2f} B GPT at "
        f"{t['train']['tokens_per_step']:,} tokens per step, stage 3, fp32 AdamW:"
    )
    rows = [("mode", "step (ms)", "x none", "allocator peak (GB)", "host at rest (GB)")]
    for name, r in runs.items():
        rows.append((
            f"`{name}`", f"{r['train']['step_ms_median']:,.0f}",
            f"{r['train']['step_ms_median'] / none['step_ms_median']:.1f}",
            f"{r['allocator_peak_bytes'] / 1e9:.2f}", f"{r['host_bytes_at_rest'] / 1e9:.2f}",
        ))  # fmt: skip
    return text + "\n\n" + _md_table(rows)


README_GPU = (
    "<!-- gpu-check: generated by scripts/figures.py --readme README.md -->",
    "<!-- gpu-check: end -->",
)


RETIRED = ("mock8", "table2")
"""GPU-check pieces that needed only a compile: CI compiles them for GPUs without one
(tests/core/gpu_target, scripts/gpu_compile.py, scripts/table2_gpu.py)."""


def _unmeasured(gpu: dict[str, Any]) -> list[str]:
    """The pieces and parts of the GPU check that have no figures (an error, e.g. their
    time ran out)."""
    found = []
    for name, piece in gpu["pieces"].items():
        if name in RETIRED:
            continue
        parts = piece.get("parts")
        if parts is None:
            found += [name] if "error" in piece else []
            continue
        found += [f"{name}:{k}" for k, v in parts.items() if isinstance(v, dict) and "error" in v]
    return found


def gpu_summary_md(gpu: dict[str, Any] | None, extra_unrun: tuple[str, ...] = ()) -> str:
    """What the lent GPU measured (``benchmarks/gpu_check.json``), as a paragraph: the
    device, JAX and date; each stage's step against plain ``jit``; offload's peak and step
    time; what has no figures yet (and ``extra_unrun``: parts that this JSON predates)."""
    if gpu is None or gpu.get("dry_run"):
        return "No GPU has run `scripts/gpu_check.sh` yet: every figure here is from CPU."
    m = gpu["machine"]
    dates = [v["ran_at"] for k, v in gpu["pieces"].items() if v.get("ran_at") and k not in RETIRED]
    n1 = gpu["pieces"].get("n1", {}).get("targets", [])
    ratios = [t["measured"] for t in n1 if t.get("status") != "SKIP"]
    text = [
        f"`scripts/gpu_check.sh` ran on a lent {m['device_kind']} (jax {m['jax']}, "
        f"{min(dates)[:10]}; `benchmarks/gpu_check.json`):"
    ]
    if ratios:
        text.append(f"stages 0-3 cost {min(ratios):.3f}-{max(ratios):.3f} x plain `jit`'s step.")
    runs = _gpu_offload(gpu) or {}
    none = runs.get("none")
    for name, r in runs.items():
        if name != "none":
            time = r["train"]["step_ms_median"] / none["train"]["step_ms_median"]
            peak = r["allocator_peak_bytes"] / none["allocator_peak_bytes"]
            text.append(
                f"Offload `{name}`: {peak:.2f} x no offload's device peak, {time:.1f} x its "
                "step time."
            )
    text += _agreement_sentence(gpu["pieces"].get("agreement"))
    missing = [*_unmeasured(gpu), *extra_unrun]
    if missing:
        text.append(f"No figures yet: {', '.join(f'`{x}`' for x in missing)}.")
    return " ".join(text)


def _agreement_sentence(piece: dict[str, Any] | None) -> list[str]:
    """The agreement piece in one sentence: how far the compile for compile-only GPUs was
    from the GPU's own, per figure at the worst stage (and with autotuning off, if run)."""
    stages = [v for v in (piece or {}).get("stages", {}).values() if "rel_diff" in v]
    if not stages:
        return []
    worst = lambda key, f: max(v[key][f] for v in stages if key in v)
    said = ", ".join(f"{f} {worst('rel_diff', f):.2%}" for f in ("argument", "output", "temp"))
    text = (
        f"The compile for a compile-only {piece['device_kind'].removeprefix('NVIDIA ')} "
        f"against the GPU's own at stages 0-3 (target 1 %): {said}"
    )
    if all("rel_diff_untuned" in v for v in stages):
        text += f"; against it with autotuning off, temp {worst('rel_diff_untuned', 'temp'):.2%}"
    if all("rel_diff_tuned" in v for v in stages):
        text += f"; with the GPU's autotuning loaded, temp {worst('rel_diff_tuned', 'temp'):.2%}"
    return [text + "."]


def readme_block(gpu: dict[str, Any] | None) -> str:
    """The README's GPU paragraph, between its markers."""
    measured = _gpu_offload(gpu) or {}
    unrun = tuple(f"offload_fixed:{p}" for p in ("host_delayed", "ratio_half") if p not in measured)
    pieces = (gpu or {}).get("pieces", {})  # the pieces added since the H200's run:
    since = ("offload_32k", "host_rate", "agreement")
    unrun += tuple(p for p in since if gpu is not None and p not in pieces)
    return "\n".join([README_GPU[0], gpu_summary_md(gpu, unrun), README_GPU[1]])


def write_readme(path: Path, gpu: dict[str, Any] | None) -> None:
    """Replaces the README's GPU paragraph (between its markers) with today's."""
    text = path.read_text()
    start, end = text.index(README_GPU[0]), text.index(README_GPU[1]) + len(README_GPU[1])
    path.write_text(text[:start] + readme_block(gpu) + text[end:])


# ----------------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path, source: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None, "Source": source_tag(source)})


def plot_stages(bench: dict[str, Any], path: Path, source: Path) -> None:
    """Per device, stages 0-3 and plain ``jit``: memory (model states, compiled peak) and
    communication per step (measured, ring-model theory). The README's figure."""
    runs = [r for r in bench["runs"] if r["name"] in STAGE_RUNS]
    names = [r["name"] for r in runs]
    x = range(len(runs))
    fig = _figure(9.0, 3.6)
    mem, comm = fig.subplots(1, 2)
    w = 0.38
    mem.bar([i - w / 2 for i in x], [r["model_state_bytes_per_device"] / 1e6 for r in runs], w,
            label="model states")  # fmt: skip
    mem.bar([i + w / 2 for i in x], [r["peak_bytes_per_device"] / 1e6 for r in runs], w,
            label="compiled peak")  # fmt: skip
    mem.set_title("memory per device (MB)")
    comm.bar([i - w / 2 for i in x], [r["comm_bytes_per_device"]["total"] / 1e6 for r in runs],
             w, label="measured (HLO)")  # fmt: skip
    comm.bar([i + w / 2 for i in x], [r["theory_comm_bytes_per_device"] / 1e6 for r in runs], w,
             label="ring-model theory")  # fmt: skip
    comm.set_title("communication per step per device (MB)")
    for ax in (mem, comm):
        ax.set_xticks(list(x), names)
        ax.legend(frameon=False, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    m = bench["model"]
    fig.suptitle(
        f"{m['name']} ({m['params'] / 1e6:.1f}M params, {m['dtype']}), "
        f"{bench['devices']} {bench['platform']} devices",
        fontsize=10,
    )
    _save(fig, path, source)


def plot_variants(bench: dict[str, Any], path: Path, source: Path) -> None:
    """Every run: step time, compiled peak and bytes per step."""
    runs = bench["runs"]
    names = [r["name"] for r in runs]
    fig = _figure(10.0, 3.4)
    axes = fig.subplots(1, 3)
    panels = [
        ("step time (ms)", [r["step_ms_median"] for r in runs]),
        ("compiled peak per device (MB)", [r["peak_bytes_per_device"] / 1e6 for r in runs]),
        ("communication per step (MB)", [r["comm_bytes_per_device"]["total"] / 1e6 for r in runs]),
    ]
    for ax, (title, values) in zip(axes, panels):
        ax.barh(range(len(runs)), values, color="#4c72b0")
        ax.set_yticks(range(len(runs)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    _save(fig, path, source)


def plot_max_model(mm_json: dict[str, Any], path: Path, source: Path) -> None:
    """The largest model per stage: measured (compiled) against the estimator."""
    stages = mm_json["max_model"]["stages"]
    names = [s["name"] for s in stages]
    x = range(len(stages))
    fig = _figure(8.0, 3.8)
    ax = fig.add_subplot()
    w = 0.27
    series = [
        ("measured (compiled device peak fits)", "params", -w),
        ("estimator", "estimate_params", 0.0),
        ("estimator, model states only", "estimate_params_model_states", w),
    ]
    for label, key, dx in series:
        ax.bar([i + dx for i in x], [s[key] / 1e6 for s in stages], w, label=label)
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("parameters (M)")
    ax.set_title(f"largest model within {mm_json['max_model']['budget']} per device", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, source)


def plot_memory_vs_devices(bench: dict[str, Any], path: Path, source: Path) -> None:
    """Model states per device against N for stages 0-3 (the estimator, ZeRO's Figure 1),
    with the benchmark's measured points (``jzero.cli.plot``)."""
    from jzero.cli.plot import plot_model_states, read_measured

    path.parent.mkdir(parents=True, exist_ok=True)
    plot_model_states(
        str(path),
        params=bench["model"]["params"],
        precision="fp32" if bench["model"]["dtype"] == "float32" else "mixed",
        measured=read_measured(str(source)),
    )


# ------------------------------------------------------------------------------------ main
def plot_offload_time(off: dict[str, Any], path: Path, source: Path, gpu=None) -> None:
    """Where each offload mode's step time goes: on CPU, the update (timed alone, where it
    runs) and the rest of the step (``time_split``); on the lent GPU, no offload's step and
    what each mode adds to it (copies and the host's update, not told apart)."""
    split = off["time_split"]
    runs = _gpu_offload(gpu)
    fig = _figure(10.0, 3.6)
    cpu, dev = fig.subplots(1, 2) if runs else (fig.subplots(1, 1), None)
    names = list(split)
    update = [split[n]["update_ms"] for n in names]
    cpu.bar(names, update, label="update (timed alone, where it runs)")
    rest = [max(split[n]["step_ms"] - u, 0.0) for n, u in zip(names, update)]
    cpu.bar(names, rest, bottom=update, label="the rest: forward, backward, collectives")
    cpu.set_title(f"{off['devices']} {off['platform']} devices: ms per step", fontsize=9)
    cpu.tick_params(axis="x", labelrotation=45, labelsize=7)
    if runs:
        gnames = list(runs)
        none = runs["none"]["train"]["step_ms_median"]
        dev.bar(gnames, [none] * len(gnames), label="no offload's step")
        extra = [runs[n]["train"]["step_ms_median"] - none for n in gnames]
        dev.bar(gnames, extra, bottom=[none] * len(gnames), label="copies + host update")
        dev.set_title(f"{gpu['machine']['device_kind']}: ms per step", fontsize=9)
    for ax in (cpu, dev):
        if ax is not None:
            ax.legend(frameon=False, fontsize=7)
            ax.grid(axis="y", alpha=0.3)
    _save(fig, path, source)


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def generate(out: Path) -> list[Path]:
    """Writes every fragment and plot into ``out``; returns what it wrote."""
    out.mkdir(parents=True, exist_ok=True)
    bench_path, mm_path = BENCH / "bench_cpu8.json", BENCH / "max_model_cpu8.json"
    bench, mm = _read(bench_path), _read(mm_path)
    if bench is None or mm is None:
        raise SystemExit(f"{bench_path} and {mm_path} are needed: scripts/bench.py writes them.")
    main_job_png = None
    if MAIN_JOB.with_suffix(".png").exists():  # drawn by the main job itself: copied in
        shutil.copyfile(MAIN_JOB.with_suffix(".png"), out / "main_job_cpu8.png")
        main_job_png = "/_generated/main_job_cpu8.png"
    texts = {
        "bench_heading.md": _heading(bench),
        "bench_runs.md": bench_runs_md(bench),
        "bench_stages.md": bench_runs_md(bench, STAGE_RUNS),
        "bench_variants.md": bench_runs_md(bench, _stage3_runs(bench)),
        "bench_ratios.md": bench_ratios_md(bench),
        "bench_user_step.md": user_step_md(bench),
        "bench_targets.md": bench_targets_md(bench),
        "bench_checkpoint.md": checkpoint_md(bench["checkpoint"]),
        "max_model.md": max_model_md(mm),
        "table2_gpu.md": table2_gpu_md(_read(BENCH / "table2_gpu.json")),
        "gpu_compile.md": gpu_compile_md(_read(BENCH / "gpu_compile_h200.json")),
        "gpu_plans.md": gpu_plans_md(_read(BENCH / "gpu_plans.json")),
        "compile_time.md": compile_time_md(
            [_read(BENCH / "compile_time_cpu8.json"), _read(BENCH / "compile_time_h200.json")]
        ),
        "accuracy.md": accuracy_md(_read(BENCH / "accuracy_cpu8.json")),
        "matrices.md": matrices_md(_read(BENCH / "matrices_cpu8.json")),
        "frozen_peer.md": frozen_peer_md(_read(BENCH / "frozen_peer_trials.json")),
        "autoconfig.md": autoconfig_md(_read(BENCH / "autoconfig_cpu8.json")),
        "main_job.md": main_job_md(_read(MAIN_JOB.with_suffix(".json")), main_job_png),
        "offload.md": offload_md(
            _read(BENCH / "offload_cpu8.json"), _read(BENCH / "gpu_check.json")
        ),
        "gpu_check.md": gpu_summary_md(_read(BENCH / "gpu_check.json")),
    }
    written = []
    for name, text in texts.items():
        (out / name).write_text(text + "\n")
        written.append(out / name)
    plots = [
        (plot_stages, bench, bench_path, "stages_cpu8.png"),
        (plot_variants, bench, bench_path, "runs_cpu8.png"),
        (plot_memory_vs_devices, bench, bench_path, "memory_vs_devices.png"),
        (plot_max_model, mm, mm_path, "max_model_cpu8.png"),
    ]
    for plot, data, source, name in plots:
        plot(data, out / name, source)
        written.append(out / name)
    off_path = BENCH / "offload_cpu8.json"
    if off_path.exists():
        plot_offload_time(_read(off_path), out / "offload_time.png", off_path,
                          _read(BENCH / "gpu_check.json"))  # fmt: skip
        written.append(out / "offload_time.png")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "_generated")
    parser.add_argument(
        "--headline", type=Path, help="write only the README's figure (stages_cpu8.png) here"
    )
    parser.add_argument(
        "--readme", type=Path, help="rewrite only this README's GPU paragraph (its markers)"
    )
    args = parser.parse_args(argv)
    if args.readme:
        write_readme(args.readme, _read(BENCH / "gpu_check.json"))
        print(args.readme)
        return
    if args.headline:
        source = BENCH / "bench_cpu8.json"
        plot_stages(json.loads(source.read_text()), args.headline, source)
        print(args.headline)
        return
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    sys.exit(main())
