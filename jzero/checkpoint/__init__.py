"""Checkpoints: Orbax save/restore of ZeRO states that reshards across stages, device counts
and precisions, with per-leaf checksums; consolidated safetensors export/import."""

from .checkpointer import Checkpointer as Checkpointer
from .checkpointer import Restored as Restored
from .errors import CheckpointError as CheckpointError
from .errors import CheckpointMismatchError as CheckpointMismatchError
from .errors import CheckpointNotFoundError as CheckpointNotFoundError
from .errors import CheckpointSaveError as CheckpointSaveError
from .export import export_safetensors as export_safetensors
from .export import load_safetensors as load_safetensors
