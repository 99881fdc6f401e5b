"""The earlier name of :mod:`distmetrics.tensor_stats`: ``dm.inspect.initialize(config)`` and
``import distmetrics.inspect`` keep working and give that same module."""

import sys

from . import tensor_stats

sys.modules[__name__] = tensor_stats
