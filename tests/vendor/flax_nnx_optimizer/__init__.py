"""Flax's tests of ``nnx.Optimizer`` (``optimizer_test.py``), vendored unchanged, run on
``jzero.nnx.Optimizer`` by ``conftest.py``; see SOURCE.md."""
