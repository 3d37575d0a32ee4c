"""``jzero.autoconfigure``: the selection on synthetic candidate tables (the ZeRO paper's
Table 2 from the other side), the micro-batch arithmetic (the global batch and single-device
Optax's numerics kept), one search end to end on a small model (the chosen step compiles
within the budget and runs), and the answer when nothing fits."""

import dataclasses
import math
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    assert_tree_close,
    awkward_batches,
    awkward_loss,
    awkward_params,
    make_tx,
    reference,
    regression_batches,
    stacked_loss,
    stacked_params,
)

import jzero
from jzero.autoconfig import DeviceModel, Row, select
from jzero.autoconfig.candidates import (
    RECOMPUTE,
    Shape,
    accumulations,
    describe,
    micro_batch,
    partial_share,
    shapes,
)

# Fixed rates, so that every prediction here is arithmetic, never a measurement.
MODEL = DeviceModel(
    flops_per_s=1e10, collective_s=1e-5, collective_bytes_per_s=1e9, host_copy_bytes_per_s=1e9,
    host_update_bytes_per_s=1e10,
)  # fmt: skip
N = 8


def _row(stage, device_bytes, seconds, *, budget, offload=0.0, accum=1, delay=False):
    config = Shape(stage, offload, False, delay).config(
        jzero.ZeroConfig(stage=0), accum=accum, bucket=False, prefetch=False
    )
    dropped = None if device_bytes <= budget else "compiled peak > budget"
    return Row(describe(config), config, 1, device_bytes, device_bytes, 0, 0.0, 0, 0.0, seconds,
               dropped)  # fmt: skip


def test_select_the_fastest_that_fits_and_among_ties_the_simplest():
    rows = [
        _row(0, 90, 1.00, budget=50),  # too big
        _row(2, 40, 1.02, budget=50),
        _row(1, 45, 1.01, budget=50),
        _row(3, 10, 1.50, budget=50),
        _row(3, 20, 0.80, budget=50, offload=1.0),  # fastest
    ]
    assert select(rows).config == rows[4].config
    rows[4] = _row(3, 20, 1.00, budget=50, offload=1.0)  # now within 5 % of stage 1 and 2
    assert select(rows).config.stage == 1  # the lowest stage of the tie
    assert select(rows, tie=0.0).config == rows[4].config
    assert select([_row(0, 90, 1.0, budget=50)]) is None


@pytest.mark.parametrize("stage_that_fits", [0, 1, 2, 3])
def test_table_2_from_the_other_side(stage_that_fits):
    """At N = 8 with Adam in mixed precision (K = 12), the largest model of each stage
    (model states alone, the paper's Table 2) is trained at the lowest stage that holds it,
    and at stage 3 exactly where stages 0-2 do not: the candidates' memory is the
    estimator's, their predicted time the ring bytes of their collectives (2Ψ for stages
    0-2, 3Ψ for stage 3, in fp16)."""
    budget = 16e9
    largest = [jzero.max_params(device_memory=budget, devices=N, stage=s) for s in range(4)]
    assert largest == sorted(largest)
    psi = largest[stage_that_fits]
    rows = []
    for stage in range(4):
        states = jzero.estimate(params=psi, devices=N, stage=stage).model_state_bytes
        ring = (3 if stage == 3 else 2) * psi * 2 * (N - 1) / N
        rows.append(_row(stage, states, MODEL.step_seconds(0, ring), budget=budget))
    assert select(rows).config.stage == stage_that_fits
    fits = [r.config.stage for r in rows if r.fits]
    assert min(fits) == stage_that_fits  # and every stage above it fits too
    assert fits == list(range(stage_that_fits, 4))


def test_the_micro_batch_arithmetic_keeps_the_global_batch():
    assert accumulations(64, 8) == (1, 2, 4, 8)
    assert accumulations(24, 4) == (1, 2, 3, 6)
    for k in accumulations(96, 8):
        assert micro_batch(96, 8, k) * k * 8 == 96
    with pytest.raises(ValueError, match="a global batch of 20 rows does not split over 8"):
        accumulations(20, 8)
    with pytest.raises(ValueError, match="do not split into 5 micro-batches"):
        micro_batch(64, 8, 5)


@pytest.mark.parametrize(("shape", "accum"), [(Shape(3, 0.0, False), 4), (Shape(1, 0.0, False), 2)])
def test_every_accumulation_trains_as_single_device_optax_on_the_global_batch(shape, accum):
    """A candidate's accumulation changes how the global batch is cut, not what is learnt:
    fp32, the same updates as one device on the whole batch (to rounding, as the parity
    tests state it)."""
    params, batches = awkward_params(), awkward_batches(3, batch_size=32)
    base = jzero.ZeroConfig(stage=0)
    config = shape.config(base, accum=accum, bucket=shape.stage >= 2, prefetch=False)
    assert config.step.grad_accum == accum and config.stage == shape.stage
    opt = jzero.ZeroOptimizer(make_tx(), jzero.data_mesh(), config=config)
    state, step = opt.init(params), opt.train_step(awkward_loss)
    for batch in batches:
        state, _ = step(state, batch)
    want = reference(make_tx(), params, awkward_loss, batches)
    assert_tree_close(opt.full_params(state), want.params, rtol=1e-6, atol=1e-6)


def test_recompute_is_stage_3_s_nothing_saveable():
    config = Shape(3, 0.0, True).config(
        jzero.ZeroConfig(stage=0), accum=2, bucket=False, prefetch=False
    )
    assert config.step.remat_policy is RECOMPUTE is jax.checkpoint_policies.nothing_saveable
    assert describe(config) == "zero3 recompute accum=2"


def _search(budget, **kwargs):
    shapes = jax.eval_shape(stacked_params)
    batch = jax.eval_shape(lambda: regression_batches(1, 32, 64)[0])
    return jzero.autoconfigure(
        stacked_loss, shapes, batch=batch, mesh=jzero.data_mesh(), tx=optax.adam(1e-2),
        device_budget=budget, device_model=MODEL, **kwargs,
    )  # fmt: skip


@pytest.mark.smoke  # the folder's promise: a search that compiles, runs and fits
def test_a_search_end_to_end_chooses_a_step_that_compiles_and_runs_within_the_budget(capsys):
    choice = _search(150e3)
    _check_progress(capsys.readouterr().err, choice)
    chosen = choice.chosen
    assert choice.config is not None and chosen is not None and chosen.fits
    assert chosen.device_bytes <= 150e3
    for row in choice.rows:  # every compiled row over the budget is dropped, and says so
        if row.device_bytes is not None and row.device_bytes > 150e3:
            assert row.dropped.startswith("compiled peak")
    fitting = [r.seconds for r in choice.rows if r.fits]
    assert chosen.seconds <= min(fitting) * 1.05
    assert {r.config.stage for r in choice.rows} == {0, 1, 2, 3}
    assert choice.compiled == sum(r.device_bytes is not None for r in choice.rows)
    assert chosen.name in choice.table() and "<- chosen" in choice.table()
    # the chosen configuration, built and run, is the one compiled (peak within budget)
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), config=choice.config)
    state, step = opt.init(stacked_params()), opt.train_step(stacked_loss)
    batch = regression_batches(1, 32, 64)[0]
    peak = jzero.accounting.memory_spaces.of_compiled(step.lower(state, batch).compile())
    assert peak["device"] == chosen.device_bytes <= 150e3
    # its report, read from the search's own compile, is the built step's
    assert choice.report() == jzero.report(step, state, batch)
    pickled = pickle.loads(pickle.dumps(choice))  # all but the executable, which does not pickle
    assert pickled.rows == choice.rows and pickled.config == choice.config
    with pytest.raises(ValueError, match="holds no compiled step.*call jzero.report"):
        pickled.report()
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


def _check_progress(said: str, choice) -> None:
    """Off a terminal (pytest's stderr), a search says, line by line, before compiling: the
    devices and the budget, then what the estimator skipped and why; then each candidate
    as it compiles, i of n, in the order of the rows; then how it ended."""
    lines = said.splitlines()
    assert lines[0] == "jzero.autoconfigure: planning for 8 x cpu, a device budget of 0.15 MB each"
    skipped = [r for r in choice.rows if r.dropped and "(estimate)" in r.dropped]
    assert lines[1] == (
        "jzero.autoconfigure: skipped without compiling, their model states over the 0.15 MB "
        f"budget by the estimate: zero0 ({skipped[0].estimate_bytes / 1e6:,.2f} MB)"
    )  # stage 0 alone: its every accumulation is a row
    assert {r.config.stage for r in skipped} == {0}
    compiled = [r.name for r in choice.rows if r.device_bytes is not None]
    line = re.compile(r"jzero.autoconfigure: compiling (\d+) of (\d+): (.*) \(\d+ s so far\)")
    compiling = [line.fullmatch(text) for text in lines[2:-1]]
    assert [m[3] for m in compiling] == compiled
    assert [int(m[1]) for m in compiling] == list(range(1, len(compiled) + 1))
    assert all(int(m[1]) <= int(m[2]) for m in compiling)
    assert lines[-1].startswith(f"jzero.autoconfigure: {choice.search_seconds:.0f} s, ")
    assert lines[-1].endswith(f"{choice.compiled} compiled; chosen: {choice.chosen.name} (" + (
        f"compiled peak {choice.chosen.device_bytes / 1e6:,.2f} MB, predicted "
        f"{choice.chosen.seconds * 1e3:.2f} ms per step)"))  # fmt: skip


def test_prediction_is_the_stated_model_of_the_compiled_step(capsys):
    choice = _search(1e9, quiet=True)
    assert capsys.readouterr().err == ""  # quiet: no progress
    for row in (r for r in choice.rows if r.fits and r.config.offload.optimizer is None):
        want = MODEL.step_seconds(row.flops, row.collective_bytes, collectives=row.collectives)
        assert row.seconds == pytest.approx(want) and row.collectives > 0
    assert MODEL.step_seconds(2e10, 1e9, 1e9, 1e10, collectives=1e5) == pytest.approx(1 + 2 + 3)
    bucketed = [r for r in choice.rows if r.config.comm.bucket and r.fits]
    for row in bucketed:  # one collective per layer, not per leaf: never more launches
        plain = next(r for r in choice.rows if r.fits and r.config == dataclasses.replace(
            row.config, comm=dataclasses.replace(row.config.comm, bucket=False)))  # fmt: skip
        assert row.collectives <= plain.collectives


def test_when_nothing_fits_the_answer_is_the_smallest_budget_that_would():
    choice = _search(1e3)
    assert choice.config is None and choice.chosen is None
    with pytest.raises(ValueError, match="nothing to report: no configuration fits"):
        choice.report()
    smallest = choice.smallest
    assert smallest is not None and smallest.config.stage == 3
    compiled = [r.device_bytes for r in choice.rows if r.device_bytes is not None]
    assert smallest.device_bytes == min(compiled)
    text = f"the smallest that would is {smallest.device_bytes / 1e6:,.2f} MB, with {smallest.name}"
    assert text in choice.summary()
    again = _search(smallest.device_bytes)  # and at that budget, it fits
    assert again.config is not None and again.chosen.device_bytes <= smallest.device_bytes


def test_bad_inputs_are_named():
    shapes = jax.eval_shape(stacked_params)
    batch = {"x": jax.ShapeDtypeStruct((20, 64), jnp.float32)}
    with pytest.raises(ValueError, match="a global batch of 20 rows does not split over 8"):
        jzero.autoconfigure(stacked_loss, shapes, batch=batch, mesh=jzero.data_mesh(),
                            tx=optax.adam(1e-2), device_model=MODEL)  # fmt: skip
    with pytest.raises(ValueError, match="needs params= or init_fn="):
        jzero.autoconfigure(stacked_loss, batch=batch, mesh=jzero.data_mesh(),
                            tx=optax.adam(1e-2), device_model=MODEL)  # fmt: skip


def test_calibration_measures_positive_rates():
    model = jzero.autoconfig.calibrate(jzero.data_mesh(), repeats=1)
    assert all(math.isfinite(r) and r > 0 for r in model[:2])
    assert all(r > 0 for r in model)


def test_offload_candidates_are_the_whole_state_a_share_near_half_and_the_delay_if_allowed():
    base = jzero.ZeroConfig(stage=0, step=jzero.StepOptions(manual_gather=True))
    found = list(shapes(base, stages=(0, 2), offload=True, partial=0.41, delay=True))
    assert found == [
        Shape(0, 0.0, False),
        Shape(2, 0.0, False), Shape(2, 0.41, False), Shape(2, 1.0, False),
        Shape(2, 1.0, False, True),
    ]  # fmt: skip
    assert [s for s in shapes(base, stages=(2,), offload=True) if s.delay] == []
    config = found[2].config(base, accum=1, bucket=False, prefetch=False)
    assert config.offload == jzero.Offload(optimizer="host", ratio=0.41)
    assert Shape.of(config) == found[2] and describe(config) == "zero2 host0.41 accum=1"
    late = found[4].config(base, accum=1, bucket=False, prefetch=False)
    assert config.offload.delay == 0 and late.offload.delay == 1
    assert describe(late) == "zero2 host delay accum=1" and Shape.of(late) == found[4]
    # A share is a whole number of leaves, nearest half; none between nothing and all: None.
    assert partial_share([10, 30, 60]) == 0.4 and partial_share([100]) is None


def test_among_ties_less_offload_and_no_delay_are_simpler():
    rows = [
        _row(3, 20, 1.00, budget=50, offload=1.0, delay=True),
        _row(3, 20, 1.01, budget=50, offload=1.0),
        _row(3, 20, 1.02, budget=50, offload=0.5),
    ]
    assert select(rows).config.offload.ratio == 0.5
    assert select(rows[:2]).config.offload.delay == 0
    assert select(rows, tie=0.0).config.offload.delay == 1


def test_a_delayed_update_overlaps_the_host_work_with_the_device_work():
    # device: 2 s of matmuls + 1 s of collectives; host: 1 s of copies + 1 s of update
    add = MODEL.step_seconds(2e10, 1e9, 1e9, 1e10)
    assert add == pytest.approx(5.0)
    assert MODEL.step_seconds(2e10, 1e9, 1e9, 1e10, overlapped=True) == pytest.approx(3.0)
    assert MODEL.step_seconds(0, 0, 1e9, 1e10, overlapped=True) == pytest.approx(2.0)


def test_a_search_with_offload_weighs_the_partial_share_and_allowed_delay():
    """The host step for the whole state, for about half of it, and delayed; the partial
    offload's host bytes are its share's, read from its plan (not the whole state's)."""
    choice = _search(1e9, host_budget=1e9, allow_delay=True, stages=(2,))
    names = {r.name.rsplit(" accum", 1)[0] for r in choice.rows if r.device_bytes is not None}
    share = partial_share([math.prod(x.shape) for x in jax.tree.leaves(stacked_params())])
    assert {"zero2", f"zero2 host{share:.2f}", "zero2 host", "zero2 host delay"} <= names
    by_name = {r.name: r for r in choice.rows if r.device_bytes is not None}
    whole, part = by_name["zero2 host accum=1"], by_name[f"zero2 host{share:.2f} accum=1"]
    host_time = lambda r: r.seconds - MODEL.step_seconds(r.flops, r.collective_bytes,
                                                         collectives=r.collectives)  # fmt: skip
    assert 0 < host_time(part) < host_time(whole)
    late = by_name["zero2 host delay accum=1"]
    assert late.seconds <= whole.seconds
