"""``python -m jzero estimate``: its units (parameter counts, memory sizes), its tables and
JSON, its errors, and its plot of the ZeRO paper's Figure 1."""

import importlib.util
import json
import re
import sys

import pytest
from _paths import EXAMPLES, GPU_PLUGIN

import jzero.accounting.estimate as E
from jzero.cli.main import main
from jzero.cli.plot import plot_model_states, read_measured
from jzero.cli.units import MIN_BARE_BYTES, format_params, parse_bytes, parse_params


def test_max_params_takes_bytes_and_returns_0_when_nothing_fits():
    memory = parse_bytes("80GB")
    assert E.max_params(device_memory=memory, devices=64, stage=3) == 40_000_000_000 * 8
    assert E.max_params(device_memory=1e9, devices=8, stage=3, activation_bytes=2e9) == 0
    with pytest.raises(ValueError, match=r"got the string '80GB'.*e\.g\. 80e9.*parse_bytes"):
        E.max_params(device_memory="80GB", devices=64, stage=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80e9", 80e9), ("80GB", 80e9), ("80 gb", 80e9), ("80GiB", 80 * 2**30), ("512MB", 512e6),
     ("1.5T", 1.5e12), ("1048576", 2.0**20), ("64 KiB", 65536.0), ("2KB", 2000.0),
     ("1.5mib", 1.5 * 2**20), ("2TiB", 2.0 * 2**40), ("1TB", 1e12), ("80B", 80.0),
     ("0.1GB", 1e8), (".5GiB", 2.0**29), ("8Gi", 8.0 * 2**30)],
)  # fmt: skip
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80", "1024", "80.5", str(MIN_BARE_BYTES - 1)])
def test_parse_bytes_refuses_small_sizes_without_a_unit(text):
    message = f"memory size '{text}' has no unit, so it reads as {text} bytes: write {text}GB "
    with pytest.raises(ValueError, match="^" + re.escape(message) + f".* or {text}GiB "):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7B", 7e9), ("7.5B", 7.5e9), ("7.5b", 7.5e9), ("350M", 350e6), ("350m", 350e6),
     ("1.2T", 1.2e12), ("125K", 125e3), ("125k", 125e3), ("7.5e9", 7.5e9), ("7.5E9", 7.5e9),
     ("6400512", 6400512.0), (" 7 B ", 7e9), ("0", 0.0), ("1e+04T", 1e16), (".5M", 5e5)],
)  # fmt: skip
def test_parse_params(text, expected):
    assert parse_params(text) == expected


@pytest.mark.parametrize(
    ("count", "printed"),
    [(7.5e9, "7.5B"), (1e12, "1T"), (1.2e12, "1.2T"), (350e6, "350M"), (123_456, "123.5K"),
     (42, "42"), (0, "0"), (999_960_000, "1B"), (999.96, "1K"), (4_715_123_456, "4.715B"),
     (1e16, "10000T"), (1_234_500, "1.234M"), (0.5, "0.5")],
)  # fmt: skip
def test_format_params(count, printed):
    assert format_params(count) == printed


@pytest.mark.parametrize(
    "count", [10**e * m for e in range(0, 16) for m in (1, 1.5, 2.71828, 9.9995, 9.99951)]
)
def test_format_params_round_trips_to_the_printed_precision(count):
    printed = format_params(count)
    assert parse_params(printed) == float(f"{count:.4g}")  # 4 significant digits, exactly
    assert format_params(parse_params(printed)) == printed
    assert "e" not in printed.lower()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: E.estimate(params=1e9, devices=0, stage=1), "devices must be an integer >= 1"),
        (lambda: E.estimate(params=1e9, devices=8, stage=5), "stage must be 0, 1, 2 or 3"),
        (lambda: E.estimate(params=-1, devices=8, stage=1), "params must be a finite number >= 0"),
        (
            lambda: E.estimate(params=1e9, devices=8, stage=1, precision="fp16"),
            "precision must be 'mixed' or 'fp32'.*use 'mixed'",
        ),
        (lambda: parse_bytes("eighty GB"), "cannot parse memory size.*80GB"),
        (lambda: parse_bytes("1.2.3GB"), "cannot parse memory size"),
        (lambda: parse_bytes("80 XB"), r"cannot parse memory size '80 XB'.*bytes \(80e9\)"),
        (lambda: parse_bytes("-80GB"), "cannot parse memory size '-80GB'"),
        (lambda: parse_params("7X"), r"cannot parse parameter count '7X'.*\(125K, 350M, 7\.5B"),
        (lambda: parse_params("7.5GB"), "cannot parse parameter count '7.5GB'"),
        (lambda: parse_params("-1B"), "cannot parse parameter count '-1B'"),
        (lambda: parse_params(""), "cannot parse parameter count ''"),
        (lambda: parse_params("nan"), "cannot parse parameter count 'nan'"),
        (
            lambda: E.theory_comm_bytes(stage=4, param_bytes_S=1, devices=8),
            "stage must be 0, 1, 2 or 3",
        ),
        (
            lambda: E.transformer_activation_bytes(batch=0, seq=1, hidden=1, layers=1),
            "batch must be an integer >= 1",
        ),
        (
            lambda: E.max_params(device_memory=1e9, devices=8, stage=3, largest_layer_fraction=2),
            "largest_layer_fraction must be at most 1",
        ),
    ],
)
def test_bad_inputs_name_the_problem_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.smoke  # python -m jzero estimate's table
def test_cli_table(capsys):
    assert main(["estimate", "--params", "7.5e9", "--devices", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "7.5B params" in lines[0] and "N = 64" in lines[0]
    assert lines[1].split()[:3] == ["stage", "name", "params"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert [rows[s][-1] for s in "0123"] == ["120.00", "31.41", "16.64", "1.88"]


def test_cli_json_with_activations(capsys):
    argv = "estimate --params 7.5e9 --devices 64 --stage 3 --json --batch 1 --seq 1024 "
    argv += "--hidden 4096 --layers 32 --heads 32 --checkpointing --buffer-bytes 1e8"
    assert main(argv.split()) == 0
    out = json.loads(capsys.readouterr().out)
    (e,) = out["estimates"]
    assert e["stage"] == 3 and e["model_state_bytes"] == 1.875e9
    act = E.transformer_activation_bytes(
        batch=1, seq=1024, hidden=4096, layers=32, heads=32, checkpointing=True
    )
    assert e["activation_bytes"] == act and e["buffer_bytes"] == 1e8
    assert e["total_bytes"] == 1.875e9 + act + 1e8


def test_cli_reads_back_the_counts_it_prints(capsys):
    assert main(["estimate", "--params", "7.5e9", "--devices", "64"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    printed = title.split(": ")[1].split()[0]
    assert printed == "7.5B"
    outputs = []
    for params in ("7.5e9", printed, "7.5b", "7500M"):
        assert main(["estimate", "--params", params, "--devices", "64", "--json"]) == 0
        outputs.append(capsys.readouterr().out)
    assert json.loads(outputs[0])["inputs"]["params"] == 7.5e9
    assert outputs == [outputs[0]] * 4


def test_cli_reads_back_the_max_params_it_prints(capsys):
    assert main(["estimate", "--devices", "64", "--device-memory", "80GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Largest model in 85.8993 GB per device")
    assert parse_bytes(lines[0].split()[3] + "GB") == pytest.approx(80 * 2**30, rel=1e-6)
    printed = {int(line.split()[0]): line.split()[2] for line in lines[2:]}
    for stage, text in printed.items():
        psi = E.max_params(device_memory=80 * 2**30, devices=64, stage=stage)
        assert parse_params(text) == float(f"{psi:.4g}")


def test_cli_device_memory(capsys):
    assert main(["estimate", "--devices", "64", "--device-memory", "80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["device_memory_bytes"] == 80e9 and "estimates" not in out
    for row in out["max_params"]:
        assert row["params"] == E.max_params(device_memory=80e9, devices=64, stage=row["stage"])
    assert main(["estimate", "--devices", "64", "--device-memory", "80GB"]) == 0
    text = capsys.readouterr().out
    assert "Largest model in 80 GB" in text and "max params" in text


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ("estimate --params 7.5e9 --devices 64 --stage 5", "stage must be 0, 1, 2 or 3"),
        ("estimate --params 7.5e9 --devices 64 --batch 4", "add --seq, --hidden, --layers"),
        (
            "estimate --devices 64 --device-memory lots",
            "argument --device-memory: cannot parse memory size 'lots'",
        ),
        ("estimate --devices 64", "give --params"),
        ("estimate --devices 8 --params 1e9 --precision bf16", "precision must be"),
        (
            "estimate --devices 8 --params 7X",
            "argument --params: cannot parse parameter count '7X': write a number (7.5e9) or "
            "one with a K, M, B or T suffix (125K, 350M, 7.5B, 1.2T).",
        ),
        (
            "estimate --devices 8 --device-memory 80",
            "argument --device-memory: memory size '80' has no unit, so it reads as 80 bytes: "
            "write 80GB (80·10^9 bytes) or 80GiB (80·2^30 bytes), or 80B if you mean bytes.",
        ),
        ("estimate --devices 8 --params 7B --largest-layer 1Q", "argument --largest-layer"),
        ("estimate --devices 8 --params 7B --buffer-bytes 100", "argument --buffer-bytes"),
        ("estimate --devices 8 --params 7B --measured nofile.json", "nofile.json is not a bench"),
        ("estimate --devices x --params 7B", "argument --devices: invalid int value: 'x'"),
        ("estimate --params 7B", "the following arguments are required: --devices"),
        ("estimate --devices 8 --params 7B --plot /no/such/dir/m.png", "--plot /no/such/dir"),
    ],
)
def test_cli_bad_input_returns_2_with_one_line(capsys, argv, match):
    assert main(argv.split()) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith("python -m jzero estimate: error: ") and match in line


def test_cli_plot(tmp_path, capsys):
    path = tmp_path / "memory.png"
    assert main(["estimate", "--params", "7.5e9", "--devices", "64", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().err


def test_plot_with_measured_points(tmp_path):
    path = tmp_path / "measured.png"
    plot_model_states(str(path), params=1e6, measured={1: [(8, 5e6), (64, 4e6)], 3: []})
    assert path.stat().st_size > 1000


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'jzero\[examples\]'"):
        plot_model_states(str(tmp_path / "x.png"), params=1e6)


def test_plot_refuses_measurements_of_unknown_stages(tmp_path):
    with pytest.raises(ValueError, match=r"measured has stages \[4\]: key .* by ZeRO stage"):
        plot_model_states(str(tmp_path / "x.png"), params=1e6, measured={4: [(8, 1.0)]})


def test_cli_plot_overlays_benchmark_measurements(tmp_path):
    bench = {
        "devices": 8,
        "runs": [
            {"name": name, "stage": stage, "model_state_bytes_per_device": 1e6 / (stage + 1)}
            for stage, name in enumerate(["dp", "zero1", "zero2", "zero3"])
        ]
        + [{"name": "auto_fsdp", "stage": 3, "model_state_bytes_per_device": 5.0}],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert read_measured(str(path)) == {s: [(8, 1e6 / (s + 1))] for s in range(4)}
    png = tmp_path / "m.png"
    plot = lambda bench_path: main(
        ["estimate", "--params", "1e6", "--devices", "8", "--plot", str(png)]
        + ["--measured", str(bench_path)]
    )
    assert plot(path) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert plot(bad) == 2
    with pytest.raises(ValueError, match=r"bad\.json is not a benchmark JSON \(KeyError: 'runs'\)"):
        read_measured(str(bad))


def test_cli_measured_needs_plot(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"devices": 8, "runs": []}))
    assert main(["estimate", "--params", "1e6", "--devices", "8", "--measured", str(path)]) == 2
    assert capsys.readouterr().err == (
        "python -m jzero estimate: error: --measured overlays points on a plot: "
        "add --plot FILE.png.\n"
    )


GPT = str(EXAMPLES / "gpt.py") + ":problem"
TINY = ["--set", "d_model=16", "--set", "n_layers=1", "--set", "n_heads=2", "--set", "seq_len=8"]


def test_autoconfigure_prints_every_candidate_and_the_choice(capsys):
    argv = ["autoconfigure", GPT, *TINY, "--set", "batch=16", "--stages", "2,3"]
    assert main([*argv, "--device-budget", "1GB", "--json", "--quiet"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # --quiet: no progress
    out = json.loads(printed.out)
    chosen = [r for r in out["rows"] if r["name"] == out["chosen"] and r["dropped"] is None]
    assert chosen and chosen[0]["device_bytes"] <= 1e9 and chosen[0]["stage"] in (2, 3)
    assert {r["stage"] for r in out["rows"]} == {2, 3}
    assert out["compiled"] >= 2 and out["device_model"]["flops_per_s"] > 0
    assert out["summary"].startswith(f"chosen: {out['chosen']}")


def test_autoconfigure_answers_the_smallest_budget_when_nothing_fits(capsys):
    argv = ["autoconfigure", GPT, *TINY, "--set", "batch=16", "--stages", "3"]
    assert main([*argv, "--device-budget", "1KB"]) == 1
    printed = capsys.readouterr()
    assert "no configuration fits a device budget of 0.00 MB: the smallest that would is" in (
        printed.out
    )
    said = printed.err.splitlines()  # the progress, on stderr, line by line off a terminal
    assert said[0] == "jzero.autoconfigure: planning for 8 x cpu, a device budget of 0.00 MB each"
    assert said[1].startswith(
        "jzero.autoconfigure: skipped without compiling, their model states over the 0.00 MB "
        "budget by the estimate: zero3 ("
    )
    assert re.fullmatch(r"jzero.autoconfigure: compiling 1 of \d+: zero3 accum=1 \(\d+ s so far\)",
                        said[2])  # fmt: skip
    assert said[-1].startswith("jzero.autoconfigure: ") and "no configuration fits" in said[-1]


def test_autoconfigure_help_says_what_the_factory_returns(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["autoconfigure", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone
    help_text = re.sub(r"(\w)- (\w)", r"\1-\2", help_text)  # and its breaks after hyphens
    assert "see above" not in help_text
    assert (
        "FILE.py:FUNCTION a function (in FILE.py, or MODULE:FUNCTION) that returns a dict: "
        "loss_fn (the loss, as ZeroOptimizer.train_step takes it), batch (the global batch one "
        "step trains on: arrays or jax.ShapeDtypeStructs), and params (arrays or "
        "ShapeDtypeStructs) or init_fn (a function that makes them); optionally tx (an Optax "
        "transformation; default optax.adamw(3e-4)) and config (a jzero.ZeroConfig of the "
        "run's own options, kept in every candidate) "
    ) in help_text
    assert help_text.endswith(
        "Examples: python -m jzero autoconfigure examples/gpt.py:problem --set d_model=256 "
        "--set batch=64 --device-budget 16GB (examples/gpt.py's problem() returns such a "
        "dict). For GPUs that are not here: JAX_PLATFORMS=cpu python -m jzero autoconfigure "
        "examples/llama.py:problem --set size=8b --target h100:8 (Llama 3 8B on 8 H100s, "
        "compiled here for them; pip install 'jzero[gpu-compile]')."
    )


@pytest.mark.skipif(importlib.util.find_spec(GPU_PLUGIN) is None, reason="needs jzero[gpu-compile]")
@pytest.mark.xdist_group("h100_plans")
def test_autoconfigure_plans_for_gpus_that_are_not_here(capsys):
    argv = ["autoconfigure", GPT, *TINY, "--set", "batch=16", "--stages", "2", "--target"]
    assert main([*argv, "h100:8", "--json"]) == 0
    printed = capsys.readouterr()
    said = printed.err.splitlines()
    assert said[0] == (
        "jzero.autoconfigure: planning for 8 x NVIDIA H100 80GB HBM3 (compile-only, 1 host), "
        "a device budget of 63.71 GB each"
    )
    assert said[3].startswith("jzero.autoconfigure: compiling 1 of 1: zero2 accum=1 (")
    out = json.loads(printed.out)
    assert out["chosen"] == "zero2 accum=1" and out["device_budget"] == 0.75 * 84942979072
    assert out["notes"][0].startswith("offload not considered: compile-only GPUs")
    assert main([*argv, "h100:12"]) == 2
    assert "12 GPUs do not split into hosts of 8" in capsys.readouterr().err
    assert main([*argv, "h100:8x"]) == 2  # refused before the search says anything
    err = capsys.readouterr().err
    assert err.startswith("python -m jzero autoconfigure: error: GPUs 'h100:8x' are not spelled")
    assert "'h200:8x8' (HOSTSxGPUS: 8 hosts of 8)" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["examples/gpt.py"], "write FILE.py:FUNCTION or MODULE:FUNCTION"),
        (["missing.py:problem"], "missing.py: no such file"),
        ([GPT.replace(":problem", ":nothing")], "has no function 'nothing'"),
        ([GPT, "--set", "d_model"], "--set 'd_model': write KEY=VALUE"),
        (["examples/llama.py:problem", "--set", "size=13b"], "size '13b' is not one of 8b, 70b"),
    ],
)
def test_autoconfigure_bad_input_returns_2_with_one_line(argv, error, capsys):
    assert main(["autoconfigure", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and error in err
