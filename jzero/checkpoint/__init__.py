"""Checkpointing: consolidated export and Orbax save/restore of ZeRO states."""

from .checkpointer import Checkpointer as Checkpointer
from .checkpointer import CheckpointError as CheckpointError
from .checkpointer import Restored as Restored
