"""Optax's tests of its optimizers (``alias_test.py``), vendored unchanged, run on
``jzero.shard_optimizer`` by ``conftest.py``; see SOURCE.md."""
