"""Megatron-Core's Timer calls ``torch.cuda.synchronize()`` on start/stop and gathers on
``torch.cuda.current_device()``; on this CPU-only build both raise. The peer tests patch those
two calls (and nothing else of Megatron's) while Megatron's Timers run. ``Timers.write`` is given
a ``SummaryWriter`` that records its calls instead of writing an event file."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def megatron_timers_on_cpu():
    """Megatron-Core's ``Timers`` module with its two CUDA calls made CPU no-ops."""
    import torch

    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        from megatron.core import timers

        yield timers
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def recording_summary_writer():
    """A ``SummaryWriter`` (Megatron writes only to instances of it) whose ``add_scalar`` calls
    are kept in ``calls`` as argument tuples; it writes no event file."""
    from torch.utils.tensorboard import SummaryWriter

    class RecordingSummaryWriter(SummaryWriter):
        def __init__(self):  # no log folder, no event file
            self.calls = []

        def add_scalar(self, *args):
            self.calls.append(args)

        def __del__(self):
            pass

    return RecordingSummaryWriter()
