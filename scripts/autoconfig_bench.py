"""``jzero.autoconfigure`` measured: does the configuration it picks fit and run fastest?

For the example GPT at three sizes and three device budgets each, on the devices present
(8 CPU devices without an accelerator), it runs the search (one calibrated device model
for all), then builds and times the three fastest-predicted candidates that fit, side by
side in this one process (median step time over ``--steps`` steps after a warm-up), and
checks:

- ``fits``: the chosen step's compiled peak is at most the budget, and it runs;
- ``fastest``: no measured candidate of the three is faster than the chosen one by more
  than 10 %;
- ``order``: the measured order of the three agrees with the predicted one: no pair
  predicted apart (by more than ``jzero.autoconfig.search.TIE``, 5 %) is measured the
  other way round by more than the measurement's noise (the larger round-to-round spread
  of the two, at least 5 %); a pair predicted within 5 % makes no claim.

The budgets, per size: the device's memory (``loose``), 60 % of stage 0's compiled peak
(``medium``: stage 0 no longer fits) and 1.1 x the lightest candidate's (``tight``).

    python scripts/autoconfig_bench.py --json benchmarks/autoconfig_cpu8.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # name -> examples/gpt.py problem() keywords
    "gpt-s": {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32, "batch": 32},
    "gpt-m": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 32, "batch": 32},
    "gpt-l": {"d_model": 192, "n_layers": 6, "n_heads": 4, "seq_len": 32, "batch": 32},
}
FASTEST_MARGIN = 0.10  # no fitting candidate measured faster than the chosen one by more
ORDER_MARGIN = 0.05  # a reversal within this is measurement noise, not a disagreement


def _time_side_by_side(configs, problem, mesh, rounds: int, steps: int) -> list[list[float]]:
    """Per config, the seconds of each of its timed steps on real arrays, measured side by
    side: ``rounds`` rounds, each running every config for ``steps`` steps in turn (after
    two warm-up steps each), so that a slower or faster spell of the machine falls on all."""
    import jzero

    tokens = jax.random.randint(jax.random.key(0), problem["batch"]["tokens"].shape, 0, 256)
    batch = jzero.distributed.global_batch(mesh, {"tokens": tokens})
    runs = []
    for config in configs:
        opt = jzero.ZeroOptimizer(problem["tx"], mesh, config=config)
        state, step = opt.init(init_fn=problem["init_fn"]), opt.train_step(problem["loss_fn"])
        for _ in range(2):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs.append([step, state, []])
    for _ in range(rounds):
        for run in runs:
            step, state, times = run
            for _ in range(steps):
                start = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            run[1] = state
    return [times for _, _, times in runs]


def _noise(times: list[float], steps: int) -> float:
    """How much one config's rounds disagree: (slowest - fastest round median) / median."""
    rounds = [statistics.median(times[i : i + steps]) for i in range(0, len(times), steps)]
    return (max(rounds) - min(rounds)) / statistics.median(times)


def _order_agrees(measured: list[dict], tie: float) -> bool:
    """No pair of the top three predicted apart (by more than ``tie``) is measured the
    other way round by more than the measurement's own noise (the larger of the two
    configs' round-to-round spreads, at least ``ORDER_MARGIN``); a pair predicted within
    ``tie`` makes no claim on its order."""
    for i, a in enumerate(measured):
        for b in measured[i + 1 :]:
            apart = b["predicted_s"] > a["predicted_s"] * (1 + tie)
            margin = max(ORDER_MARGIN, a.get("noise", 0.0), b.get("noise", 0.0))
            if apart and b["measured_s"] * (1 + margin) < a["measured_s"]:
                return False
    return True


def _search(problem, mesh, budget, model):
    import jzero

    return jzero.autoconfigure(
        problem["loss_fn"], init_fn=problem["init_fn"], batch=problem["batch"], mesh=mesh,
        tx=problem["tx"], config=problem["config"], device_budget=budget, device_model=model,
    )  # fmt: skip


def run_size(name, keywords, mesh, model, rounds, steps) -> list[dict]:
    import gpt

    from jzero.autoconfig.search import TIE, default_device_budget
    from jzero.cli.autoconfigure import to_json

    problem = gpt.problem(**keywords)
    loose = _search(problem, mesh, default_device_budget(mesh), model)
    stage0 = min(r.device_bytes for r in loose.rows if r.config.stage == 0 and r.device_bytes)
    lightest = min(r.device_bytes for r in loose.rows if r.device_bytes)
    budgets = {"medium": 0.6 * stage0, "tight": 1.1 * lightest}
    results = [("loose", loose)] + [
        (b, _search(problem, mesh, v, model)) for b, v in budgets.items()
    ]
    out = []
    for budget_name, choice in results:
        top = sorted((r for r in choice.rows if r.fits), key=lambda r: r.seconds)[:3]
        times = _time_side_by_side([r.config for r in top], problem, mesh, rounds, steps)
        measured = [
            {"name": r.name, "predicted_s": r.seconds, "device_bytes": r.device_bytes,
             "measured_s": statistics.median(s), "noise": _noise(s, steps)}
            for r, s in zip(top, times)
        ]  # fmt: skip
        chosen = choice.chosen
        chosen_s = next(m["measured_s"] for m in measured if m["name"] == chosen.name)
        checks = {
            "fits": chosen.device_bytes <= choice.device_budget,
            "fastest": all(chosen_s <= m["measured_s"] * (1 + FASTEST_MARGIN) for m in measured),
            "order": _order_agrees(measured, TIE),
        }
        out.append({
            "size": name, "model": keywords, "budget": budget_name,
            "search": to_json(choice), "top3": measured, "checks": checks,
        })  # fmt: skip
        print(f"{name} {budget_name}: {choice.summary()} checks {checks}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the three")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per candidate per round")
    parser.add_argument("--sizes", default=",".join(SIZES), help="which sizes (default all)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT / "examples"))
    import jzero

    mesh = jzero.data_mesh()
    start = time.perf_counter()
    model = jzero.autoconfig.calibrate(mesh)
    runs = []
    for name in args.sizes.split(","):
        runs += run_size(name, SIZES[name], mesh, model, args.rounds, args.steps)
    result = {
        "jax": jax.__version__,
        "platform": jax.devices()[0].platform,
        "devices": len(jax.devices()),
        "cpu": platform.processor() or platform.machine(),
        "device_model": model._asdict(),
        "rounds": args.rounds,
        "steps": args.steps,
        "seconds": time.perf_counter() - start,
        "runs": runs,
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    failed = [
        f"{r['size']}/{r['budget']}: {k}" for r in runs for k, ok in r["checks"].items() if not ok
    ]
    print("every check passed" if not failed else f"failed: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
