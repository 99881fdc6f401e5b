"""``python -m distmetrics``: the ``distmetrics`` command, for a checkout on ``PYTHONPATH`` or an
environment whose scripts are not on ``PATH``."""

import sys

from .cli import main

sys.exit(main())
