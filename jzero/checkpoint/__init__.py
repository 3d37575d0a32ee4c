"""Checkpoints: Orbax save/restore of ZeRO states that reshards across stages, device
counts and precisions, with per-leaf checksums; consolidated safetensors export/import."""

from .checkpointer import Checkpointer as Checkpointer
from .checkpointer import Restored as Restored
from .export import export_safetensors as export_safetensors
from .export import load_safetensors as load_safetensors
from .format import CheckpointError as CheckpointError
