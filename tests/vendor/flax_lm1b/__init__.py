"""Flax's lm1b example model (``models.py``), vendored unchanged; see SOURCE.md."""
