"""Optax's own tests of its optimizers (``alias_test.py``, unchanged) on
``jzero.shard_optimizer``.

How the substitution works. The tests build every optimizer through the module
``optax._src.alias``: ``getattr(alias, opt_name)(**kwargs)`` (``_get_opt``), or
``alias.sgd(...)``, ``alias.lbfgs(...)`` directly, at the time the test runs. For each test
(once per variant of ``vendor/peer_failures.py``: stage 3 on 2 devices in CI; stages 1-3,
and on 8 devices, with ``JZERO_PEER_VARIANTS=all``) an autouse fixture monkeypatches each
of the module's optimizer
constructors -- the functions defined in ``alias.py`` and the ``functools.partial`` s of
them (``nadam``, ``nadamw``) -- with one that builds Optax's optimizer and returns
``jzero.shard_optimizer(tx, mesh, stage=S)`` on the variant's mesh. Nothing else
of Optax is touched: what the test composes around the optimizer (``inject_hyperparams``,
``MultiSteps``, ``optax.tree.map_params``, ``jax.jit``, ``jax.lax.cond``) wraps the sharded
one, as a user's code would. A constructor that Optax calls from inside another (e.g. a
call of ``adam`` made while building ``adamw``) is left Optax's, so each optimizer is
sharded once.

Placing the parameters. jzero tells a user to place the parameters with
``jzero.shard_params(params, mesh, stage=S)`` before ``init`` (the docstrings of
``shard_optimizer`` and ``shard_params``, ``docs/guides/own_step.md``): at stage 3 ``init``
refuses parameters not placed so; at stages 0-2 the placement spares the user's jitted step
a second compile. The tests make their parameters as
concrete arrays on one device and hand them straight to ``init``. The harness does what
the user is told: the wrapper places the concrete parameters it receives outside ``jit``
(in ``init``, and in ``update`` when called outside ``jit``) with ``jzero.shard_params(params,
mesh, layout=..., stage=S)`` (the variant's mesh and stage) before handing them on.
Inside ``jit`` (tracers) the parameters go on as the test gives them: the harness never
changes what the test itself computes with, only the arguments of the transformation.
So a test that trains its own unplaced array in a jitted step still sees it come back on
the mesh after the first step (see the cause "recompiles" in ``vendor/peer_failures.py``).

Warnings. The project turns every warning into an error; Optax's own test setup has no
warning filters. The two warnings the upstream tests raise themselves (JAX truncating a
float64 that optax's L-BFGS asks for with x64 off; scikit-learn's deprecated ``penalty``)
are let through as upstream does, on these tests only; any other warning, jzero's
included, still fails.

``JZERO_PEER_SUBSTITUTE=0``: the upstream tests as they are, once each, no jzero.
``JZERO_PEER_DEVICES=N``: the mesh over the first N devices only (on all 8, no parameter of
these tests divides, so every leaf stays replicated; on 2 most are sharded).
Expected failures: ``vendor/peer_failures.py`` (for the 8-device mesh).
"""

from __future__ import annotations

import functools
import threading

import jax
import optax
import pytest
from optax._src import alias

import jzero
from vendor import peer_failures as peers

SUITE = "optax_alias"
SMOKE = "test_gradient_accumulation6[2dev-stage3]"

UPSTREAM_WARNINGS = (
    "ignore:Explicitly requested dtype float64 requested in:UserWarning",
    "ignore:'penalty' was deprecated in version 1.8:FutureWarning",
)


def _is_constructor(name: str, value) -> bool:
    if name.startswith("_") or not callable(value) or isinstance(value, type):
        return False
    func = value.func if isinstance(value, functools.partial) else value
    return getattr(func, "__module__", None) == alias.__name__


CONSTRUCTORS = {name: f for name, f in vars(alias).items() if _is_constructor(name, f)}
"""Optax's optimizer constructors: every public function of ``alias.py`` (and partial)."""

_building = threading.local()


def pytest_itemcollected(item):
    """Every case ``extended`` (tests/_ci_tier.py), for CI's time: 623 tests took 17
    CPU-minutes of CI's 2-core machine at one stage, and none fails at one stage and not
    another. Flax's suite, the vendored models and jzero's own Optax parity tests of the
    user's step are CI's seams with the peers' code; ``scripts/test.sh -m ''`` runs these.
    One case is in the smoke selection (tests/README.md): Optax's own test that
    ``MultiSteps`` accumulates an optimizer's updates as it should, on
    ``jzero.shard_optimizer`` (most of its convergence tests are expected failures here:
    vendor/peer_failures.py)."""
    item.add_marker(pytest.mark.extended)
    if item.name == SMOKE:
        item.add_marker(pytest.mark.smoke)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    return peers.make_case(collector, name, obj, suite=SUITE, warning_filters=UPSTREAM_WARNINGS)


def _concrete(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and not any(isinstance(x, jax.core.Tracer) for x in leaves)


def sharded(tx: optax.GradientTransformation, variant: peers.Variant):
    """``tx`` through ``jzero.shard_optimizer`` in ``variant``, placing the concrete
    parameters it is given as the module docstring says."""
    mesh = variant.mesh()
    inner = jzero.shard_optimizer(tx, mesh, **variant.options)
    layout, stage = variant.layout_object, variant.stage

    def place(params):
        if params is None or not _concrete(params):
            return params
        return jzero.shard_params(params, mesh, layout=layout, stage=stage)

    def init(params):
        return inner.init(place(params))

    def update(updates, state, params=None, **extra):
        return inner.update(updates, state, place(params), **extra)

    return optax.GradientTransformationExtraArgs(init, update)


def _substitute(constructor, variant: peers.Variant):
    @functools.wraps(constructor)
    def build(*args, **kwargs):
        if getattr(_building, "depth", 0):  # called by another constructor: Optax's own
            return constructor(*args, **kwargs)
        _building.depth = 1
        try:
            tx = constructor(*args, **kwargs)
        finally:
            _building.depth = 0
        return sharded(tx, variant)

    return build


@pytest.fixture(autouse=True)
def _jzero_shard_optimizer(request, monkeypatch):
    variant = peers.variant_of(request)
    if variant is not None:
        for name, constructor in CONSTRUCTORS.items():
            monkeypatch.setattr(alias, name, _substitute(constructor, variant))
    yield
