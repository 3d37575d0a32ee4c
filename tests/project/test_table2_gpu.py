"""scripts/table2_gpu.py: ``--quick`` (8 compile-only H200s, a tiny GPT, a 256 MB budget)
writes the JSON benchmarks/README.md describes, each found depth fitting and one layer
more not; the committed benchmarks/table2_gpu.json meets each target it records as met
with its own figures (the full search is not re-run here)."""

import json

import pytest
from _paths import GPU_PLUGIN, REPO, load_script

COMMITTED = REPO / "benchmarks" / "table2_gpu.json"
TOP_FIELDS = {
    "jax", "jaxlib", "cuda_plugin", "quick", "memory_formula", "budget_fraction", "model",
    "paper", "targets", "resumed", "wall_seconds",
}  # fmt: skip
TARGET_FIELDS = {
    "name", "gpu", "device_kind", "devices", "hosts", "precision", "device_memory_size",
    "budget_bytes", "stages",
}  # fmt: skip
STAGE_FIELDS = {
    "stage", "width", "heads", "layers", "params", "bytes", "fits", "next", "theory_params",
    "widths", "compiles", "compile_seconds",
}  # fmt: skip
V100_FIELDS = {"paper", "target_params", "target_met"}  # the paper's target only
BYTES = {"argument", "output", "alias", "temp", "total"}
COMPILE_FIELDS = BYTES | {"width", "layers", "params", "fits", "seconds", "xla_remat_warning"}


def _total(b: dict[str, int]) -> int:
    return b["argument"] + b["output"] - b["alias"] + b["temp"]


def check_consistent(result: dict) -> None:
    """Every stage's depth fits the budget and one layer more does not, with the bytes,
    parameters and compiles that say so."""
    assert set(result) >= TOP_FIELDS and "partial" not in result
    assert result["memory_formula"].startswith("argument + output - alias + temp")
    for t in result["targets"]:
        assert set(t) == TARGET_FIELDS, t["name"]
        budget = t["budget_bytes"]
        assert budget == pytest.approx(result["budget_fraction"] * t["device_memory_size"])
        for s in t["stages"]:
            where = f"{t['name']} stage {s['stage']}"
            assert STAGE_FIELDS <= set(s) <= STAGE_FIELDS | V100_FIELDS, where
            nxt = s["next"]
            assert set(s["bytes"]) == set(nxt["bytes"]) == BYTES, where
            assert s["bytes"]["total"] == _total(s["bytes"]), where
            assert nxt["bytes"]["total"] == _total(nxt["bytes"]), where
            assert nxt["layers"] == s["layers"] + 1 and nxt["params"] > s["params"], where
            assert s["fits"] and not nxt["fits"], where
            assert s["bytes"]["total"] <= budget < nxt["bytes"]["total"], where
            assert s["heads"] * result["model"]["head_dim"] == s["width"], where
            found = {(c["width"], c["layers"]): c for c in s["compiles"]}
            for c in s["compiles"]:
                assert set(c) == COMPILE_FIELDS and c["seconds"] > 0, where
                assert c["fits"] == (c["total"] <= budget) and c["total"] == _total(c), where
            for entry in (s, nxt):  # both were compiled, and recorded as such
                c = found[s["width"], entry["layers"]]
                assert {k: c[k] for k in BYTES} == entry["bytes"], where
                assert c["params"] == entry["params"], where
            assert {w["width"] for w in s["widths"]} >= {s["width"]}, where
            assert s["compile_seconds"] == pytest.approx(
                sum(c["seconds"] for c in s["compiles"]), abs=0.1
            )
            # each width's depth is linear in its parameters
            w = next(w for w in s["widths"] if w["width"] == s["width"])
            assert s["params"] == w["params_base"] + s["layers"] * w["params_per_layer"], where
    assert result["wall_seconds"] >= sum(
        s["compile_seconds"] for t in result["targets"] for s in t["stages"]
    )


@pytest.mark.slow
# CI's time: the script's own run is extended (scripts/test.sh -m ''); CI checks its JSON
@pytest.mark.extended
def test_quick_run_writes_a_consistent_search(tmp_path):
    pytest.importorskip(
        GPU_PLUGIN,
        reason="needs JAX's CUDA plugin: pip install 'jzero[gpu-compile]' "
        "'jax-cuda12-plugin==V' 'jax-cuda12-pjrt==V' (V = jaxlib's version)",
    )
    import jax

    out = tmp_path / "t2.json"
    load_script("table2_gpu").main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result) == TOP_FIELDS and result["quick"] is True
    assert result["resumed"] == {"from": None, "stages": []}
    assert result["jax"] == jax.__version__
    [target] = result["targets"]
    assert (target["name"], target["devices"], target["hosts"]) == ("h200x8", 8, 1)
    assert target["budget_bytes"] == pytest.approx(256e6)
    assert [s["stage"] for s in target["stages"]] == [0, 3]
    assert all(set(s) == STAGE_FIELDS for s in target["stages"])  # no paper targets
    check_consistent(result)
    stage0, stage3 = target["stages"]
    assert stage3["params"] > 4 * stage0["params"]  # 8 GPUs: 16 bytes a parameter -> 2


def test_committed_table2_meets_the_targets_it_records():
    if not COMMITTED.exists():
        pytest.skip("benchmarks/table2_gpu.json is not committed yet")
    result = json.loads(COMMITTED.read_text())
    assert result["quick"] is False
    check_consistent(result)
    by_name = {t["name"]: t for t in result["targets"]}
    v100 = by_name["v100x64"]
    assert (v100["devices"], v100["hosts"], v100["gpu"]) == (64, 8, "v100")
    assert [s["stage"] for s in v100["stages"]] == [0, 1, 2, 3]
    table2 = load_script("table2_gpu")
    for s in v100["stages"]:
        assert s["target_params"] == table2.TARGETS_V100X64[s["stage"]]
        assert s["paper"] == table2.PAPER_V100X64[s["stage"]]
        met = s["fits"] and s["params"] >= s["target_params"]
        assert s["target_met"] == met, f"stage {s['stage']}"
    for t in result["targets"]:  # more sharding, a larger model
        params = [s["params"] for s in t["stages"]]
        assert params == sorted(params), t["name"]
