"""``scripts/autoconfig_bench.py``: its checks on synthetic measurements, and the committed
run (``benchmarks/autoconfig_cpu8.json``) read back: every chosen step within its budget,
its recorded checks the ones its own numbers give, and the guide's table rendered from
it. The timings themselves are the benchmark's, never asserted here."""

import json

from _paths import REPO, load_script

RUN = REPO / "benchmarks" / "autoconfig_cpu8.json"


_script = load_script


def _m(name, predicted, measured):
    return {"name": name, "predicted_s": predicted, "measured_s": measured}


def test_order_agrees_unless_a_pair_predicted_apart_measures_reversed_beyond_noise():
    agrees = _script("autoconfig_bench")._order_agrees
    assert agrees([_m("a", 1.0, 1.0), _m("b", 1.2, 1.3), _m("c", 1.5, 1.6)], 0.05)
    assert agrees([_m("a", 1.0, 1.03), _m("b", 1.2, 1.0)], 0.05)  # reversed within 5 %
    assert not agrees([_m("a", 1.0, 1.2), _m("b", 1.2, 1.0)], 0.05)  # reversed by 20 %
    assert agrees([_m("a", 1.0, 1.5), _m("b", 1.04, 1.0)], 0.05)  # predicted tie: no claim
    noisy = [_m("a", 1.0, 1.2) | {"noise": 0.25}, _m("b", 1.2, 1.0) | {"noise": 0.1}]
    assert agrees(noisy, 0.05)  # reversed by 20 %, within a 25 % spread of rounds


def test_the_committed_run_is_read_back_from_its_own_numbers():
    bench, run = _script("autoconfig_bench"), json.loads(RUN.read_text())
    sizes = {r["size"] for r in run["runs"]}
    assert sizes == set(bench.SIZES) and len(run["runs"]) == 3 * len(sizes)
    for r in run["runs"]:
        search, top = r["search"], r["top3"]
        chosen = next(
            x for x in search["rows"] if x["name"] == search["chosen"] and x["dropped"] is None
        )
        assert chosen["device_bytes"] <= search["device_budget"] and r["checks"]["fits"]
        times = {m["name"]: m["measured_s"] for m in top}
        fastest = all(
            times[chosen["name"]] <= s * (1 + bench.FASTEST_MARGIN) for s in times.values()
        )
        assert r["checks"]["fastest"] == fastest
        assert r["checks"]["order"] == bench._order_agrees(top, 0.05)
        fitting = sorted(
            (x for x in search["rows"] if x["dropped"] is None and x["seconds"]),
            key=lambda x: x["seconds"],
        )
        assert [m["name"] for m in top] == [x["name"] for x in fitting[:3]]


def test_the_guide_table_is_rendered_from_the_committed_run():
    figures, run = _script("figures"), json.loads(RUN.read_text())
    text = figures.autoconfig_md(run)
    for r in run["runs"]:
        assert f"`{r['search']['chosen']}`" in text
        for m in r["top3"]:
            assert (
                f"{m['name']}: {m['predicted_s'] * 1e3:.1f} / {m['measured_s'] * 1e3:.1f}" in text
            )
