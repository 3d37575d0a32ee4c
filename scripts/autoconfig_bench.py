"""``jzero.autoconfigure`` measured: does the configuration it picks fit and run fastest?

For the example GPT at three sizes and three device budgets each, on the devices present
(8 CPU devices without an accelerator), it runs the search (one calibrated device model
for all), then builds and times the three fastest-predicted candidates that fit, side by
side in this one process (median step time over ``--steps`` steps after a warm-up), and
checks:

- ``fits``: the chosen step's compiled peak is at most the budget, and it runs;
- ``fastest``: no measured candidate of the three is faster than the chosen one by more
  than 10 %;
- ``order``: the measured order of the three agrees with the predicted one, pairs
  predicted within ``jzero.autoconfig.search.TIE`` of each other counting as ties (a tie
  agrees when the two measure within 10 % of each other).

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


def _time_steps(config, problem, mesh, steps: int) -> float:
    """Median seconds of one step of ``config`` on real arrays (after two warm-up steps)."""
    import jzero

    opt = jzero.ZeroOptimizer(problem["tx"], mesh, config=config)
    state = opt.init(init_fn=problem["init_fn"])
    step = opt.train_step(problem["loss_fn"])
    tokens = jax.random.randint(jax.random.key(0), problem["batch"]["tokens"].shape, 0, 256)
    batch = jzero.distributed.global_batch(mesh, {"tokens": tokens})
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _order_agrees(measured: list[dict], tie: float) -> bool:
    """Every pair of the top three: predicted apart -> measured in that order; predicted
    within ``tie`` -> measured within ``FASTEST_MARGIN`` of each other."""
    for i, a in enumerate(measured):
        for b in measured[i + 1 :]:
            if b["predicted_s"] > a["predicted_s"] * (1 + tie):
                if not b["measured_s"] >= a["measured_s"]:
                    return False
            elif abs(a["measured_s"] - b["measured_s"]) > FASTEST_MARGIN * min(
                a["measured_s"], b["measured_s"]
            ):
                return False
    return True


def _search(problem, mesh, budget, model):
    import jzero

    return jzero.autoconfigure(
        problem["loss_fn"], init_fn=problem["init_fn"], batch=problem["batch"], mesh=mesh,
        tx=problem["tx"], config=problem["config"], device_budget=budget, device_model=model,
    )  # fmt: skip


def run_size(name, keywords, mesh, model, steps) -> list[dict]:
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
        measured = [
            {"name": r.name, "predicted_s": r.seconds, "device_bytes": r.device_bytes,
             "measured_s": _time_steps(r.config, problem, mesh, steps)}
            for r in top
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
    parser.add_argument("--steps", type=int, default=10, help="timed steps per candidate")
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
        runs += run_size(name, SIZES[name], mesh, model, args.steps)
    result = {
        "jax": jax.__version__,
        "platform": jax.devices()[0].platform,
        "devices": len(jax.devices()),
        "cpu": platform.processor() or platform.machine(),
        "device_model": model._asdict(),
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
