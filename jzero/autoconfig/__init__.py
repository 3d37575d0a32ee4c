"""Choosing a configuration: :func:`jzero.autoconfigure` (``search``), the candidates it
weighs (``candidates``), the device model it predicts step times with
(``device_model``), GPUs that are not here (``target``) and what it says as it searches
(``progress``)."""

from .device_model import DeviceModel as DeviceModel
from .device_model import calibrate as calibrate
from .search import Choice as Choice
from .search import Row as Row
from .search import autoconfigure as autoconfigure
from .search import select as select
