"""Memory: host RSS on every machine; CUDA allocator statistics where there is a GPU.

Read on log steps only (host-side counters: no device sync). Every value is reduced as a max
across ranks with the rank that holds it, so the report is the worst rank's, not the writer's.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .base import Alert, LogContext, Sample

__all__ = ["MemoryCollector"]

GIB = 1024 ** 3

# (name, path in torch.cuda.memory_stats_as_nested_dict(), scale). The nested dict is what the
# allocator returns; torch.cuda.memory_stats() flattens all of it in Python first (about 160
# recursive calls, 0.15-0.2 ms of a log step on an H100 machine) for the six values read here.
_CUDA_STATS = (
    ("memory/allocated_gib", ("allocated_bytes", "all", "current"), GIB),
    ("memory/max_allocated_gib", ("allocated_bytes", "all", "peak"), GIB),
    ("memory/reserved_gib", ("reserved_bytes", "all", "current"), GIB),
    ("memory/max_reserved_gib", ("reserved_bytes", "all", "peak"), GIB),
    ("memory/alloc_retries", ("num_alloc_retries",), 1),
    ("memory/ooms", ("num_ooms",), 1),
)


class MemoryCollector:
    """Samples of host and device memory for the log step's MAX pack."""

    name = "memory"
    after = ()
    writes = ("memory/",)

    def __init__(self) -> None:
        self._rss = _RssReader()
        self._cuda = torch.cuda.is_available()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Current host RSS and CUDA allocator statistics (host-side counters, no device sync)."""
        out = [Sample("memory/host_rss_gib", self._rss.read() / GIB, "max")]
        if self._cuda:
            stats = torch.cuda.memory_stats_as_nested_dict()  # {} before CUDA is initialised
            for name, path, scale in _CUDA_STATS:
                value = stats
                for key in path:
                    value = value.get(key, 0) if isinstance(value, dict) else 0
                out.append(Sample(name, float(value) / scale, "max"))
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive."""
        return []

    def close(self) -> None:
        """Let go of ``/proc/self/statm``."""
        self._rss.close()


class _RssReader:
    """This process's resident set size in bytes: on Linux one ``pread`` of ``/proc/self/statm``
    (kept open: a log step reads it in about a microsecond), elsewhere psutil's ``memory_info``."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._process = None
        try:
            self._fd: Optional[int] = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY)
        except OSError:  # no procfs: macOS, Windows
            import psutil

            self._fd, self._process = None, psutil.Process()

    def read(self) -> int:
        if self._fd is None:
            return self._process.memory_info().rss
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            import psutil

            self._process = psutil.Process()  # a read after close still answers

    def __del__(self) -> None:  # a Monitor never closed does not keep the descriptor
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
