"""The suite tests the CPU paths for real: gloo process groups, packs on the host, timers read
from a FakeClock. Where torch sees a GPU, timers would record CUDA events and the memory
collector read the CUDA allocator, and those tests would measure something else. So the GPU is
hidden from the suite (``CUDA_VISIBLE_DEVICES`` empty, set before torch first looks for a
device; spawned ranks inherit it), and the GPU suite, ``tests/test_cuda.py``, runs when it is
the only file asked for: ``python -m pytest tests/test_cuda.py`` (``launch/test.sh`` runs it
after the suite on a machine where torch sees a GPU)."""

import os

GPU_SUITE = "test_cuda.py"


def pytest_configure(config):
    asked = [os.path.basename(str(arg).split("::")[0]) for arg in config.args]
    if not asked or any(name != GPU_SUITE for name in asked):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
