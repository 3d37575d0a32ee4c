"""Beyond one host: ``jax.distributed`` set-up with bounded failure, process-local data."""

from .data import global_batch as global_batch
from .runtime import initialize as initialize
from .runtime import is_main_process as is_main_process
from .watchdog import bounded as bounded
