"""scripts/bench.py on a tiny GPT: the JSON it writes has docs/design.md §5's schema."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
RUN_NAMES = ["dp", "zero1", "zero2", "zero3", "auto_fsdp"]
RUN_FIELDS = {
    "name": str,
    "stage": int,
    "model_state_bytes_per_device": int,
    "theory_model_state_bytes_per_device": float,
    "peak_bytes_per_device": int,
    "comm_bytes_per_device": dict,
    "theory_comm_bytes_per_device": float,
    "step_ms_median": float,
    "steps_timed": int,
    "loss_first": float,
    "loss_last": float,
}
COMM_KEYS = {"all-reduce", "reduce-scatter", "all-gather", "other", "total"}


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bench_json_schema(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "x.json"
    argv = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16"]
    argv += ["--batch", "8", "--warmup", "1", "--steps", "2", "--json", str(out)]
    bench.main(argv)
    assert "zero3" in capsys.readouterr().out  # the readable table was printed too

    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and result["devices"] == 8
    assert isinstance(result["jax"], str)
    model = result["model"]
    assert {"name", "params", "layers", "dtype"} <= model.keys()
    assert model["layers"] == 1 and model["dtype"] == "float32" and model["params"] > 0
    assert [r["name"] for r in result["runs"]] == RUN_NAMES
    for run, stage in zip(result["runs"], [0, 1, 2, 3, 3]):
        assert set(run) == set(RUN_FIELDS), run["name"]
        for field, kind in RUN_FIELDS.items():
            assert isinstance(run[field], kind), (run["name"], field)
        assert run["stage"] == stage
        comm = run["comm_bytes_per_device"]
        assert set(comm) == COMM_KEYS and all(isinstance(v, float) for v in comm.values())
        assert comm["total"] == pytest.approx(sum(v for k, v in comm.items() if k != "total"))
        assert run["steps_timed"] == 2 and run["step_ms_median"] > 0
        assert run["model_state_bytes_per_device"] > 0 and run["peak_bytes_per_device"] > 0
        assert math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])
    # The same model, data and optimizer in every run: the same first loss.
    first = {r["loss_first"] for r in result["runs"]}
    assert max(first) - min(first) <= 1e-6 * max(first)
