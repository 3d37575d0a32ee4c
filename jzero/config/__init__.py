"""Configuration read from other tools' files: DeepSpeed's JSON config
(:func:`from_deepspeed_config`)."""

from .deepspeed import BatchSizes as BatchSizes
from .deepspeed import DeepSpeedOptions as DeepSpeedOptions
from .deepspeed import from_deepspeed_config as from_deepspeed_config
from .findings import DeepSpeedConfigError as DeepSpeedConfigError
from .findings import DeepSpeedConfigWarning as DeepSpeedConfigWarning
