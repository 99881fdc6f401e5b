"""The suite tests the CPU paths for real: gloo process groups, packs on the host, timers read
from a FakeClock. Where torch sees a GPU, timers would record CUDA events and the memory
collector read the CUDA allocator, and those tests would measure something else. So the GPU is
hidden from the suite (``CUDA_VISIBLE_DEVICES`` empty, set before torch first looks for a
device; spawned ranks inherit it), and the GPU suite, ``tests/test_cuda.py``, runs when it is
the only file asked for: ``python -m pytest tests/test_cuda.py`` (``launch/test.sh`` runs it
after the suite on a machine where torch sees a GPU).

Once collected, and again after each test file, the objects of the suite's process are frozen out
of the garbage collector's reach (``gc.freeze``, after a collection): a Monitor looks once through
the objects the collector tracks for a DDP module made around its model
(``distmetrics.grad_sync``), and the collected tests, torch, megatron-core and what the files before
imported are hundreds of thousands of objects that hold none of a later test's: 20-50 ms per
Monitor made in this process, some 700 Monitors in PyTorch's ported clip tests alone. What a test
makes is searched and collected as before."""

import gc
import os

import pytest

GPU_SUITE = "test_cuda.py"


def pytest_configure(config):
    asked = [os.path.basename(str(arg).split("::")[0]) for arg in config.args]
    if not asked or any(name != GPU_SUITE for name in asked):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_finish(session):
    _freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the file's module-scoped fixtures are torn down by now where the next test is in another file
    if nextitem is None or nextitem.path != item.path:
        _freeze()


def _freeze() -> None:
    gc.collect()  # garbage is freed first, not kept for good
    gc.freeze()
