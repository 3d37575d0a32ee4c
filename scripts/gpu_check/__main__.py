"""``python -m gpu_check`` (``scripts/`` on ``PYTHONPATH``): :func:`.driver.main`."""

import sys

from .driver import main

sys.exit(main())
