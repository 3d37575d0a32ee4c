"""``scripts/offload_bench.py``: its triad and split on synthetic numbers, a quick run end to
end (every field written, every mode trained), and the committed run
(``benchmarks/offload_cpu8.json``) read back into the offload guide's table and figure.
The timings themselves are the benchmark's, never asserted here."""

import json

import pytest
from _paths import REPO, load_script

RUN = REPO / "benchmarks" / "offload_cpu8.json"
GPU = REPO / "benchmarks" / "gpu_check.json"


_script = load_script


def _table_rows(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[1:] if "---" not in r]


def test_the_triad_counts_twelve_bytes_per_element_and_is_positive():
    rate = _script("offload_bench").triad(2, elements=2**16, repeats=1)
    assert rate > 0


def test_the_time_split_adds_up_to_each_step():
    bench = _script("offload_bench")
    runs = {
        "none": {"step_ms_median": 100.0, "host_share_of_state": 0.0},
        "half": {"step_ms_median": 130.0, "host_share_of_state": 0.5},
    }
    update = {
        "device": {"seconds": 0.01, "params": 1000},
        "host": {"seconds": 0.03, "params": 1000},
    }
    split = bench.time_split(runs, update, model_params=1000)
    assert split["none"] == {"forward_backward_ms": 90.0, "update_ms": 10.0, "rest_ms": 0.0,
                             "step_ms": 100.0}  # fmt: skip
    assert split["half"]["update_ms"] == pytest.approx(20.0)  # half at each rate
    assert split["half"]["rest_ms"] == pytest.approx(20.0)


@pytest.mark.slow
# CI's time: the script's own run is extended (scripts/test.sh -m ''); CI checks its JSON
@pytest.mark.extended
def test_a_quick_run_writes_every_mode(tmp_path):
    out = tmp_path / "offload.json"
    result = _script("offload_bench").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    names = [m["name"] for m in result["modes"]]
    assert names == ["none", "host", "host_delayed", "streamed",
                     "ratio_0.25", "ratio_0.5", "ratio_0.75"]  # fmt: skip
    by = {m["name"]: m for m in result["modes"]}
    assert by["none"]["host_bytes_at_rest"] == 0 and by["host"]["host_share_of_state"] == 1.0
    assert 0 < by["ratio_0.5"]["host_bytes_at_rest"] < by["host"]["host_bytes_at_rest"]
    assert set(result["time_split"]) == set(names)


def test_the_committed_run_is_read_back_into_the_guide(tmp_path):
    run, gpu = json.loads(RUN.read_text()), json.loads(GPU.read_text())
    upd = run["host_update"]
    assert upd["over_triad"] == upd["bytes_per_s"] / run["triad"]["threads_bytes_per_s"]
    figures = _script("figures")
    text = figures.offload_md(run, gpu)
    tables = text.split("\n\n")
    cpu_rows = _table_rows(next(t for t in tables if "device peak (MB)" in t))
    gpu_rows = _table_rows(next(t for t in tables if "allocator peak (GB)" in t))
    assert [r[0] for r in cpu_rows] == [f"`{m['name']}`" for m in run["modes"]]
    for row, m in zip(cpu_rows, run["modes"]):
        assert float(row[1]) == round(m["step_ms_median"], 1)
        assert float(row[3]) == round(m["device_peak_bytes"] / 1e6, 3)
        assert float(row[5]) == round(m["host_share_of_state"], 2)
    fixed = gpu["pieces"]["offload_fixed"]["parts"]
    measured = [k for k, v in fixed.items() if "train" in v]
    assert [r[0] for r in gpu_rows] == [f"`{k}`" for k in measured]
    for row, k in zip(gpu_rows, measured):
        assert float(row[1].replace(",", "")) == round(fixed[k]["train"]["step_ms_median"])
        assert float(row[3]) == round(fixed[k]["allocator_peak_bytes"] / 1e9, 2)
    assert f"{upd['over_triad']:.2f} x the" in text
    written = figures.generate(tmp_path)
    assert tmp_path / "offload_time.png" in written
    from PIL import Image

    with Image.open(tmp_path / "offload_time.png") as image:
        assert image.text["Source"] == figures.source_tag(RUN)
