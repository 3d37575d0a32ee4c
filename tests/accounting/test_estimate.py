"""Memory estimator and CLI: ZeRO paper Table 1, inverse, optional terms, units, errors."""

import ast
import json
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

import jzero.accounting.estimate as E

# ZeRO paper (arXiv:1910.02054) Table 1: GB (1e9 bytes) per device, K = 12, mixed precision.
# Row: DP degree N, then P_os, P_os+g, P_os+g+p (stages 1, 2, 3) for Ψ = 7.5B, 128B, 1T.
PSIS = (7.5e9, 128e9, 1e12)
TABLE_1 = {
    1: ("120 120 120", "2048 2048 2048", "16000 16000 16000"),
    4: ("52.5 41.3 30", "896 704 512", "7000 5500 4000"),
    16: ("35.6 21.6 7.5", "608 368 128", "4750 2875 1000"),
    64: ("31.4 16.6 1.88", "536 284 32", "4187 2218 250"),
    256: ("30.4 15.4 0.47", "518 263 8", "4046 2054 62.5"),
    1024: ("30.1 15.1 0.12", "513 257 2", "4011 2013 15.6"),
}
CELLS = [
    (psi, n, stage, printed)
    for n, groups in TABLE_1.items()
    for psi, group in zip(PSIS, groups, strict=True)
    for stage, printed in zip((1, 2, 3), group.split(), strict=True)
]
# Cells the paper prints truncated (floored) rather than rounded: every one is an integer
# column of the 128B / 1T models, e.g. 2000 + 218.75 = 2218.75 printed as 2218.
TRUNCATED = {
    (128e9, 1024, 1),  # 513.5
    (128e9, 1024, 2),  # 257.75
    (1e12, 64, 1),  # 4187.5
    (1e12, 64, 2),  # 2218.75
    (1e12, 256, 1),  # 4046.875
    (1e12, 256, 2),  # 2054.6875
    (1e12, 1024, 1),  # 4011.71875
    (1e12, 1024, 2),  # 2013.671875
}


def _to_printed(value: float, printed: str, rounding: str) -> Decimal:
    step = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
    return Decimal(repr(value)).quantize(step, rounding=rounding)


def _gb(psi: float, n: int, stage: int) -> float:
    return E.estimate(params=psi, devices=n, stage=stage).model_state_bytes / 1e9


@pytest.mark.parametrize(("psi", "n", "stage", "printed"), CELLS)
def test_zero_table_1_cell(psi, n, stage, printed):
    value = _gb(psi, n, stage)
    rounding = ROUND_FLOOR if (psi, n, stage) in TRUNCATED else ROUND_HALF_UP
    assert _to_printed(value, printed, rounding) == Decimal(printed)


def test_zero_table_1_rounding_exceptions_are_exactly_the_truncated_cells():
    off = {
        (psi, n, stage)
        for psi, n, stage, printed in CELLS
        if _to_printed(_gb(psi, n, stage), printed, ROUND_HALF_UP) != Decimal(printed)
    }
    assert off == TRUNCATED


@pytest.mark.parametrize("psi", PSIS)
def test_stage_0_is_16_psi(psi):
    assert all(_gb(psi, n, 0) == 16 * psi / 1e9 for n in TABLE_1)


def test_breakdown_and_to_dict():
    e = E.estimate(params=1000, devices=4, stage=2, activation_bytes=7, buffer_bytes=3)
    assert (e.params_bytes, e.grads_bytes, e.optimizer_bytes) == (2000, 500, 3000)
    d = e.to_dict()
    assert d["model_state_bytes"] == 5500 and d["total_bytes"] == 5510 and d["stage"] == 2
    assert json.loads(json.dumps(d)) == d
    assert [t.stage for t in E.stage_table(params=1000, devices=4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("stage", E.STAGES)
def test_theory_model_state_bytes_matches_estimate(stage):
    kw = dict(params=3e9, devices=8, stage=stage)
    theory = E.theory_model_state_bytes(**kw, param_bytes=2, grad_bytes=2, opt_bytes=12)
    assert theory == E.estimate(**kw).model_state_bytes


@pytest.mark.parametrize(("stage", "factor"), [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_theory_comm_bytes(stage, factor):
    assert E.theory_comm_bytes(stage=stage, param_bytes_S=800, devices=8) == factor * 700
    assert E.theory_comm_bytes(stage=stage, param_bytes_S=800, devices=1) == 0


def test_fp32_vs_mixed():
    psi, n = 1000, 4
    fp32 = E.estimate(params=psi, devices=n, stage=1, precision="fp32")
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4000, 4000, 2000)
    mixed = E.estimate(params=psi, devices=n, stage=1)
    assert (mixed.params_bytes, mixed.grads_bytes, mixed.optimizer_bytes) == (2000, 2000, 3000)
    # Default K: 8 for fp32 (no separate master copy), so stages 0 and 3 cost 16Ψ either way.
    for stage in (0, 3):
        kw = dict(params=psi, devices=n, stage=stage)
        assert E.estimate(**kw, precision="fp32").total_bytes == E.estimate(**kw).total_bytes
    assert E.estimate(params=psi, devices=1, stage=0, precision="fp32", k=12).total_bytes == 20000


@pytest.mark.parametrize("stage", E.STAGES)
def test_model_parallel_divides_params_first(stage):
    kw = dict(devices=8, stage=stage, activation_bytes=5.0, buffer_bytes=3.0)
    split = E.estimate(params=4e9, model_parallel=4, largest_layer_params=4e8, **kw)
    assert split == E.estimate(params=1e9, largest_layer_params=1e8, **kw)


def test_gathered_layer_only_at_stage_3_and_doubled_by_prefetch():
    kw = dict(params=1e9, devices=8, largest_layer_params=1e6)
    assert [E.estimate(stage=s, **kw).gathered_layer_bytes for s in E.STAGES] == [0, 0, 0, 2e6]
    assert E.estimate(stage=3, prefetch=True, **kw).gathered_layer_bytes == 4e6
    assert E.estimate(stage=3, precision="fp32", **kw).gathered_layer_bytes == 4e6
    assert E.estimate(**kw | {"devices": 1}, stage=3).gathered_layer_bytes == 0  # nothing gathered


def test_activation_formulas():
    b, s, h, layers, a = 2, 16, 8, 3, 4
    act = lambda **kw: E.transformer_activation_bytes(batch=b, seq=s, hidden=h, **kw)
    assert act(layers=layers) == layers * 34 * b * s * h
    full_layer = 34 * b * s * h + 5 * a * s**2 * b
    assert act(layers=layers, heads=a) == layers * full_layer
    ckpt = act(layers=layers, heads=a, checkpointing=True)
    assert ckpt == layers * 2 * b * s * h + full_layer
    assert act(layers=layers, heads=a, model_parallel=2) == layers * full_layer / 2


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("grow", ["batch", "seq", "hidden", "layers", "heads"])
def test_activations_grow_monotonically(checkpointing, grow):
    base = dict(batch=2, seq=128, hidden=64, layers=4, heads=4, checkpointing=checkpointing)
    small = E.transformer_activation_bytes(**base)
    assert E.transformer_activation_bytes(**base | {grow: 2 * base[grow]}) > small


@pytest.mark.parametrize("layers", [2, 4, 48])
def test_checkpointing_saves_memory_beyond_one_layer(layers):
    kw = dict(batch=4, seq=1024, hidden=512, layers=layers, heads=8)
    with_ckpt = E.transformer_activation_bytes(**kw, checkpointing=True)
    assert with_ckpt < E.transformer_activation_bytes(**kw)


@pytest.mark.parametrize("stage", E.STAGES)
@pytest.mark.parametrize("devices", [1, 8, 1024])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"precision": "fp32", "model_parallel": 8},
        {"activation_bytes": 3.3e9, "buffer_bytes": 5e8, "largest_layer_params": 1e8},
        {"largest_layer_fraction": 0.03, "prefetch": True, "k": 16},
    ],
)
def test_max_params_is_the_largest_that_fits(stage, devices, extra):
    memory = 80e9
    psi = E.max_params(device_memory=memory, devices=devices, stage=stage, **extra)
    fraction = extra.pop("largest_layer_fraction", 0.0)
    fixed = extra.pop("largest_layer_params", 0.0)
    total = lambda p: (
        E.estimate(
            params=p,
            devices=devices,
            stage=stage,
            largest_layer_params=fixed + fraction * p,
            **extra,
        ).total_bytes
    )
    assert psi > 0
    assert total(psi) <= memory < total(psi + 1)


def test_module_does_not_import_jax():
    tree = ast.parse(Path(E.__file__).read_text())
    imported = [
        alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names
    ]
    imported += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert not [m for m in imported if m and m.split(".")[0] in ("jax", "numpy", "matplotlib")]
