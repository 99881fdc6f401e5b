"""A stand-in for the ``pynvml`` module (NVML cannot exist on a machine without an NVIDIA GPU).

It is installed in ``sys.modules`` at the import boundary, so the library's real code paths run
against it: handles by UUID, scripted energy counters, NOT_SUPPORTED errors, telemetry values.
Every call is recorded so tests can check *how* the library asked (by UUID, never by index).
"""

from __future__ import annotations

import types
from typing import Optional

NVML_ERROR_NOT_SUPPORTED = 3


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def make(devices: dict[str, list[int]], unsupported_energy: bool = False,
         unsupported: Optional[set] = None, throttle: Optional[dict] = None) -> types.ModuleType:
    """devices: UUID → successive readings of its energy counter (mJ; an exception instance is
    raised when its turn comes), in enumeration order; throttle: UUID → its clocks event reasons
    bitmask (else GPU idle, and SW thermal slowdown on the fourth GPU)."""
    m = types.ModuleType("pynvml")
    m.calls = []
    m.NVMLError = NVMLError
    m.NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU, m.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1, 0, 1
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    m.nvmlClocksEventReasonGpuIdle = 0x1
    uuids = list(devices)
    readings = {u: list(v) for u, v in devices.items()}
    unsupported = unsupported or set()

    def record(name, *args):
        m.calls.append((name,) + args)

    def nvmlInit():
        record("nvmlInit")

    def nvmlDeviceGetHandleByUUID(uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        record("nvmlDeviceGetHandleByUUID", uuid)
        if uuid not in devices:
            raise NVMLError(13)  # NOT_FOUND
        return uuid

    def nvmlDeviceGetHandleByIndex(index):
        record("nvmlDeviceGetHandleByIndex", index)
        return uuids[index]

    def nvmlDeviceGetTotalEnergyConsumption(handle):
        record("nvmlDeviceGetTotalEnergyConsumption", handle)
        if unsupported_energy:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        values = readings[handle]
        value = values.pop(0) if len(values) > 1 else values[0]
        if isinstance(value, Exception):  # a reading that fails (a scripted NVML error)
            raise value
        return value

    m.failing = {}  # reading's function name → an NVML error code it raises from now on (a GPU lost: 15)

    def reader(name, value):
        def read(handle, *args):
            record(name, handle, *args)
            if name in unsupported:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            if name in m.failing:
                raise NVMLError(m.failing[name])
            return value(uuids.index(handle)) if callable(value) else value
        return read

    m.nvmlInit = nvmlInit
    m.nvmlDeviceGetHandleByUUID = nvmlDeviceGetHandleByUUID
    m.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex
    m.nvmlDeviceGetTotalEnergyConsumption = nvmlDeviceGetTotalEnergyConsumption
    m.nvmlDeviceGetClockInfo = reader("nvmlDeviceGetClockInfo", lambda i: 1500 + 10 * i)
    m.nvmlDeviceGetMaxClockInfo = reader("nvmlDeviceGetMaxClockInfo", 1980)
    m.nvmlDeviceGetPowerUsage = reader("nvmlDeviceGetPowerUsage", lambda i: 250_000 + 25_000 * i)  # mW
    m.nvmlDeviceGetTemperature = reader("nvmlDeviceGetTemperature", lambda i: 60 + i)
    m.nvmlDeviceGetTemperatureThreshold = reader("nvmlDeviceGetTemperatureThreshold", 87)
    m.nvmlDeviceGetUtilizationRates = reader("nvmlDeviceGetUtilizationRates",
                                             lambda i: types.SimpleNamespace(gpu=90 + i, memory=40))
    m.nvmlDeviceGetPcieThroughput = reader("nvmlDeviceGetPcieThroughput", 2048)
    m.nvmlDeviceGetFanSpeed = reader("nvmlDeviceGetFanSpeed", 30)
    m.nvmlDeviceGetCurrentClocksEventReasons = reader("nvmlDeviceGetCurrentClocksEventReasons", lambda i: (
        throttle[uuids[i]] if throttle else 0x1 | (0x20 if i == 3 else 0)))
    m.nvmlSystemGetDriverVersion = lambda: "999.99"
    return m
