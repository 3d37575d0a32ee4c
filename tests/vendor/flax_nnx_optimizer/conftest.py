"""Flax's own tests of ``nnx.Optimizer`` (``optimizer_test.py``, unchanged) on
``jzero.nnx.Optimizer``.

How the substitution works. The test module does ``from flax import nnx`` and builds its
optimizers as ``nnx.Optimizer(model, tx, wrt=...)`` and ``nnx.ModelAndOptimizer(model,
tx)`` (Flax 0.12's deprecated optimizer that keeps the model; one test subclasses it), at
the time each test runs. For each test (once per variant of ``vendor/peer_failures.py``:
stage 3 on 2 devices in CI; stages 1-3, and 8 devices, with
``JZERO_PEER_VARIANTS=all``) an autouse fixture
replaces the module's global ``nnx`` with a stand-in that is ``flax.nnx`` in every name but two:

- ``Optimizer``: ``jzero.nnx.Optimizer`` with the variant's ``mesh`` (a ``jzero.data_mesh``)
  and ``stage=S`` filled in, the rest of ``nnx.Optimizer``'s signature
  (``model, tx, *, wrt, graph=None``) as it is;
- ``ModelAndOptimizer``: ``jzero.nnx.ModelAndOptimizer`` the same way (``wrt=nnx.Param``
  by default, as Flax's). Where jzero has none, Flax 0.12.12's own class
  (``flax/nnx/training/optimizer.py``: ``self.model``, and ``update(grads, **kwargs)`` for
  ``update(self.model, grads, **kwargs)``) over jzero's Optimizer.

Flax itself is not patched (``flax.nnx.Optimizer`` stays Flax's for every other module,
jzero's included), nor is anything else the tests use. At stage 3 ``jzero.nnx.Optimizer``
places the model's Params sharded itself, as its docstring says, so the harness adds
nothing there. Warnings: the project's filters (every warning an error) are those of
Flax's own test setup too, so none are let through.

``JZERO_PEER_SUBSTITUTE=0``: the upstream tests as they are, once each, no jzero.
``JZERO_PEER_DEVICES=N``: the mesh over the first N devices only (on all 8, no parameter of
these tests divides, so every leaf stays replicated; on 2 most are sharded).
Expected failures: ``vendor/peer_failures.py`` (for the 8-device mesh).
"""

from __future__ import annotations

import functools
import types

import pytest
from flax import nnx

import jzero
from vendor import peer_failures as peers

SUITE = "flax_nnx_optimizer"
SMOKE = "test_jit0[2dev-stage3]"  # Flax's own jitted train step, on jzero's nnx.Optimizer


def pytest_itemcollected(item):
    """One case in the smoke selection (tests/README.md)."""
    if item.name == SMOKE:
        item.add_marker(pytest.mark.smoke)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    return peers.make_case(collector, name, obj, suite=SUITE)


@functools.cache
def substitutes(variant: peers.Variant) -> dict[str, type]:
    """``Optimizer`` and ``ModelAndOptimizer`` on jzero, in ``variant``."""
    mesh, options = variant.mesh(), variant.options

    class Optimizer(jzero.nnx.Optimizer):
        __doc__ = f"``jzero.nnx.Optimizer`` on the variant's mesh with {options}."

        def __init__(self, model, tx, *, wrt, graph=None):
            super().__init__(model, tx, wrt=wrt, mesh=mesh, graph=graph, **options)

    if hasattr(jzero.nnx, "ModelAndOptimizer"):

        class ModelAndOptimizer(jzero.nnx.ModelAndOptimizer):
            __doc__ = f"``jzero.nnx.ModelAndOptimizer`` on the variant's mesh with {options}."

            def __init__(self, model, tx, *, wrt=nnx.Param):
                super().__init__(model, tx, wrt=wrt, mesh=mesh, **options)

    else:  # a jzero without its own: Flax 0.12.12's class, over jzero's Optimizer

        class ModelAndOptimizer(Optimizer):
            """Flax 0.12.12's ``nnx.ModelAndOptimizer``, over jzero's Optimizer."""

            def __init__(self, model, tx, *, wrt=nnx.Param):
                super().__init__(model, tx, wrt=wrt)
                self.model = model

            def update(self, grads, /, **kwargs):  # type: ignore[override]
                return super().update(self.model, grads, **kwargs)

    return {"Optimizer": Optimizer, "ModelAndOptimizer": ModelAndOptimizer}


class _Nnx(types.ModuleType):
    """``flax.nnx`` with some names replaced."""

    def __init__(self, replaced: dict[str, type]):
        super().__init__(nnx.__name__, nnx.__doc__)
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(nnx, name)


@pytest.fixture(autouse=True)
def _jzero_nnx_optimizer(request, monkeypatch):
    variant = peers.variant_of(request)
    if variant is not None:
        monkeypatch.setattr(request.module, "nnx", _Nnx(substitutes(variant)))
    yield
