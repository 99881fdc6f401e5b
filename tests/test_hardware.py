"""Hardware and throughput metrics.

NVML cannot exist on this CPU machine: a fake ``pynvml`` module (tests/fake_pynvml.py) is put in
``sys.modules`` at the import boundary, and that is the only thing mocked. torch reports no CUDA
device here, so the energy collector is given the UUID torch would report for the rank's device
(the ``uuid`` argument); reading that UUID from ``torch.cuda.get_device_properties`` runs only on
a GPU machine. Host memory, throughput, MFU, SOL, ETA and progress.txt are real.
"""

import datetime as dt
import json
import logging
import math
import sys

import pytest

from tests import fake_pynvml
from tests.dist_utils import FakeClock, quiet_config, run_ranks

GPUS = {"GPU-0000": [], "GPU-1111": [], "GPU-2222": [], "GPU-3333": []}


@pytest.fixture
def nvml(monkeypatch):
    def install(**kwargs):
        module = fake_pynvml.make(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module
    return install


def _monitor(collectors=(), **cfg):
    import distmetrics as dm

    return dm.Monitor(quiet_config(**{"log_interval": 2, "log_throughput": True, "log_memory": True, **cfg}),
                      collectors=collectors)


def _ctx(steps=1):
    from distmetrics.collectors.base import LogContext

    return LogContext(step=steps, steps=steps, layout=None)


def test_energy_opens_the_ranks_own_gpu_by_uuid_under_remapped_visible_devices(nvml, monkeypatch):
    # CUDA_VISIBLE_DEVICES=2,3: this rank's CUDA device 1 is physical GPU 3. NVML's index 1 is a
    # neighbour (GPU-1111) whose counter runs at a different rate: reading it would be wrong.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    fake = nvml(devices={"GPU-0000": [0], "GPU-1111": [0, 999_000], "GPU-2222": [0], "GPU-3333": [5_000, 25_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    energy = EnergyCollector(world_size=1, uuid="GPU-3333")
    assert energy.enabled
    assert ("nvmlDeviceGetHandleByUUID", "GPU-3333") in fake.calls
    assert not any(c[0] == "nvmlDeviceGetHandleByIndex" for c in fake.calls)
    samples = {s.name: s.value for s in energy.take_samples(_ctx(4))}
    assert samples["energy/total_j"] == pytest.approx(20.0)  # (25000 - 5000) mJ


def test_energy_metrics_from_counter_deltas(nvml):
    # built, first monitor.step (the count starts: building the Monitor is no step's energy), log steps 2, 4
    nvml(devices={"GPU-0000": [900_000, 1_000_000, 1_050_000, 1_130_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    class Clock(FakeClock):  # the energy collector's clock too: a real one drifts from the step clock under load
        MODULES = FakeClock.MODULES + ("distmetrics.collectors.nvml",)

    with Clock() as clock:
        monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
        monitor.step(1, tokens=100)
        clock.advance(30)
        m = monitor.step(2, tokens=100)
        assert m["energy/total_j"] == pytest.approx(50.0)
        assert m["energy/j_per_gpu_per_step"] == pytest.approx(50.0)  # the one step measured: step 2
        assert m["energy/j_per_token"] == pytest.approx(50.0 / 100)
        assert m["power/max_w"] == pytest.approx(m["power/min_w"]) and m["power/max_w_rank"] == 0
        for step in (3, 4):  # both clocks restarted at step 2's log: power = energy / the same interval
            clock.advance(50)
            m = monitor.step(step, tokens=100)
    assert m["energy/total_j"] == pytest.approx(80.0)
    assert m["energy/j_per_gpu_per_step"] == pytest.approx(40.0)
    assert m["energy/job_total_j"] == pytest.approx(130.0)
    assert m["train/step_time_ms"] == pytest.approx(50.0)
    assert m["power/mean_w"] == pytest.approx(80.0 / 0.1)  # 80 J over the two steps' 100 ms


def test_the_close_record_has_no_energy_ratio_over_the_time_after_the_last_step(nvml):
    """close() comes after the last monitor.step (a final save): the NVML counter, read at close,
    holds that time's energy, while the close record's step time ends at the last step. Energy
    per step, per token and the mean power would divide the one by the other: they are left out
    of that record; the energy counted (to close) and each rank's power over it stay."""
    # readings: built, first monitor.step, log step 2, close (after step 3 and the save)
    nvml(devices={"GPU-0000": [900_000, 1_000_000, 1_050_000, 1_400_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
    monitor.step(1, tokens=100)
    assert "energy/j_per_token" in monitor.step(2, tokens=100)
    monitor.step(3, tokens=100)
    monitor.close()
    m = monitor.last_metrics
    assert m["energy/total_j"] == pytest.approx(350.0) and m["energy/job_total_j"] == pytest.approx(400.0)
    assert m["train/step_time_ms"] > 0
    assert "power/max_w" in m
    assert not [k for k in m if k in ("energy/j_per_gpu_per_step", "energy/j_per_token", "power/mean_w")]


def test_counter_wrap_is_a_small_delta(nvml):
    top = 2 ** 64
    nvml(devices={"GPU-0000": [top - 4_000, 6_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    energy = EnergyCollector(world_size=1, uuid="GPU-0000")
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(10.0)


def test_pause_leaves_evaluation_energy_out(nvml):
    # readings: start, pause, resume, log step
    nvml(devices={"GPU-0000": [0, 10_000, 70_000, 75_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    energy = EnergyCollector(world_size=1, uuid="GPU-0000")
    energy.pause()
    energy.resume()
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(15.0)


def test_an_evaluation_before_the_first_step_is_not_taken_from_training(nvml):
    # readings: built 0, pause 1_000, resume 501_000 (a 500 J evaluation), first monitor.step
    # 600_000 (the count starts), log step 900_000: training used 300 J
    nvml(devices={"GPU-0000": [0, 1_000, 501_000, 600_000, 900_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
    monitor.pause()
    monitor.resume()
    monitor.step(1, tokens=100)
    m = monitor.step(2, tokens=100)
    assert m["energy/total_j"] == pytest.approx(300.0)
    assert m["power/max_w"] > 0


def test_a_pause_open_at_the_first_step_ends_there(nvml):
    # readings: built 0, pause 1_000, start 50_000 (the pause ends: resume has nothing to read),
    # log step 100_000: counted from the start = 50 J, as the step clock counts from there
    nvml(devices={"GPU-0000": [0, 1_000, 50_000, 100_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    energy = EnergyCollector(world_size=1, uuid="GPU-0000")
    energy.pause()
    energy.start()
    energy.resume()
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(50.0)


def test_not_supported_warns_once_and_reports_nothing(nvml, caplog):
    nvml(devices={"GPU-0000": [0]}, unsupported_energy=True)
    from distmetrics.collectors.nvml import EnergyCollector

    caplog.set_level(logging.WARNING, logger="distmetrics")
    monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
    logged = [monitor.step(step, tokens=10) for step in (1, 2, 3, 4)]
    m = logged[-1]
    assert not any(k.startswith(("energy/", "power/")) for k in m)
    warnings = [r for r in caplog.records if "energy is not measured" in r.getMessage()]
    assert len(warnings) == 1


def test_no_nvml_or_no_gpu_warns_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    caplog.set_level(logging.WARNING, logger="distmetrics")
    monitor = _monitor(log_energy=True)
    m = None
    for step in (1, 2):
        m = monitor.step(step, tokens=10)
    assert not any(k.startswith(("energy/", "power/")) for k in m)
    assert len([r for r in caplog.records if "energy is not measured" in r.getMessage()]) == 1


def test_telemetry_min_max_with_ranks_and_unsupported_fields_skipped(nvml):
    nvml(devices=dict(GPUS), unsupported={"nvmlDeviceGetFanSpeed"})
    from distmetrics.collectors.nvml import TelemetryCollector

    monitor = _monitor(collectors=[TelemetryCollector(uuid="GPU-3333")])
    monitor.step(1)
    m = monitor.step(2)
    assert m["gpu/sm_clock_mhz/max"] == 1530 and m["gpu/temperature_c/min"] == 63
    assert m["gpu/utilization_pct/max"] == 93 and m["gpu/pcie_rx_mib_s/max"] == 2.0
    assert m["gpu/throttle_reasons/max"] == 0x20  # the idle bit is not a slowdown
    assert not any(k.startswith("gpu/fan_pct") for k in m)


def _throttled(rank: int, world: int) -> dict:
    masks = {"GPU-0": 0x1 | 0x4 | 0x20, "GPU-1": 0x20 | 0x40 | 0x1000}  # rank 1: one bit NVML's table lacks
    sys.modules["pynvml"] = fake_pynvml.make(devices={uuid: [] for uuid in masks}, throttle=masks)
    import distmetrics as dm
    from distmetrics.collectors.nvml import TelemetryCollector

    with dm.Monitor(quiet_config(log_interval=1), collectors=[TelemetryCollector(uuid=f"GPU-{rank}")]) as monitor:
        record = monitor.step(1)
    return {key: value for key, value in record.items() if key.startswith(("gpu/throttle", "gpu/throttled"))}


def test_each_throttle_reason_counts_the_ranks_it_slows():
    """``gpu/throttle_reasons/max`` is one rank's bitmask: a power cap on one rank hid behind a thermal
    slowdown on another. Each reason's ranks are counted (truth: the two bitmasks, bit by bit)."""
    record = run_ranks(_throttled, 2, timeout=120)[0]
    counts = {key.rsplit("/", 1)[1]: value for key, value in record.items() if key.startswith("gpu/throttled_ranks/")}
    assert counts == {"applications_clocks": 0, "sw_power_cap": 1, "hw_slowdown": 0, "sync_boost": 0,
                      "sw_thermal": 2, "hw_thermal": 1, "hw_power_brake": 0, "display_clocks": 0, "other": 1}, record
    assert record["gpu/throttle_reasons/max"] == 0x1060 and record["gpu/throttle_reasons/max_rank"] == 1
    assert record["gpu/throttle_reasons/min"] == 0x24 and record["gpu/throttle_reasons/min_rank"] == 0


def test_a_telemetry_reading_that_fails_is_said_once_and_tried_again(nvml, caplog):
    """A GPU lost mid-run (NVML_ERROR_GPU_IS_LOST, 15, from every reading) was taken for a reading the GPU
    does not support: left out for good, without a word, so gpu/ min and max named another rank's GPU."""
    caplog.set_level(logging.WARNING, logger="distmetrics")
    fake = nvml(devices=dict(GPUS))
    from distmetrics.collectors.nvml import TelemetryCollector

    monitor = _monitor(collectors=[TelemetryCollector(uuid="GPU-3333")])
    monitor.step(1)
    assert monitor.step(2)["gpu/temperature_c/max"] == 63
    fake.failing.update(nvmlDeviceGetTemperature=15, nvmlDeviceGetClockInfo=15)
    for step in (3, 4, 5, 6):
        m = monitor.step(step)
        if m is not None:
            assert not any(k.startswith(("gpu/temperature_c", "gpu/sm_clock_mhz")) for k in m), m
            assert m["gpu/utilization_pct/max"] == 93
    said = [r.getMessage() for r in caplog.records if "telemetry reading" in r.getMessage()]
    assert said == ["distmetrics: rank 0: 2 GPU telemetry reading(s) failed at step 4 (gpu/sm_clock_mhz: NVMLError: "
                    "NVML error 15): left out of the record (gpu/ min and max are then the other ranks'), and tried "
                    "again at every log step; said once"], said
    fake.failing.clear()
    monitor.step(7)
    m = monitor.step(8)
    assert m["gpu/temperature_c/max"] == 63 and m["gpu/sm_clock_mhz/max"] == 1530
    monitor.close()


def _memory_and_energy(rank: int, world: int) -> dict:
    import psutil
    import torch

    # readings: built, first step (the count starts), log steps 1 and 2
    sys.modules["pynvml"] = fake_pynvml.make(devices={f"GPU-{rank}": [0, 0, 0, 1000 * (rank + 1) * 10]})
    from distmetrics.collectors.nvml import EnergyCollector

    class Clock(FakeClock):  # the energy collector's clock too: power is energy over a chosen time
        MODULES = FakeClock.MODULES + ("distmetrics.collectors.nvml",)

    ballast = torch.ones(300 * 1024 * 1024 // 8, dtype=torch.float64) if rank == 1 else None  # ~300 MiB
    with Clock() as clock:
        monitor = _monitor(log_interval=1, collectors=[EnergyCollector(world_size=world, uuid=f"GPU-{rank}")])
        clock.advance(1000)
        monitor.step(1, tokens=50)  # the first step starts the clocks: its record measures no step
        clock.advance(1000)
        m = monitor.step(2, tokens=50)
    own_rss = psutil.Process().memory_info().rss / 1024 ** 3
    monitor.close()
    del ballast
    return {"metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))}, "rss": own_rss}


def test_host_memory_and_energy_across_ranks():
    results = run_ranks(_memory_and_energy, 2)
    m = results[0]["metrics"]
    assert m["memory/host_rss_gib/max_rank"] == 1
    assert m["memory/host_rss_gib"] == pytest.approx(results[1]["rss"], rel=0.05)
    assert m["memory/host_rss_gib"] > results[0]["rss"] + 0.2
    assert m["energy/total_j"] == pytest.approx(10.0 + 20.0)
    assert m["power/max_w_rank"] == 1 and m["power/min_w_rank"] == 0
    assert m["energy/j_per_token"] == pytest.approx(30.0 / 100)
    assert m["power/max_w"] == pytest.approx(20.0) and m["power/min_w"] == pytest.approx(10.0)  # J over 1 s


def _intervals_that_differ(rank: int, world: int) -> dict:
    # both GPUs draw 10 W: rank 0's 10 J over its 1 s interval, rank 1's 20 J over 2 s
    sys.modules["pynvml"] = fake_pynvml.make(devices={f"GPU-{rank}": [0, 0, 0, 10_000 * (rank + 1)]})
    from distmetrics.collectors.nvml import EnergyCollector

    class Clock(FakeClock):
        MODULES = FakeClock.MODULES + ("distmetrics.collectors.nvml",)

    with Clock() as clock:
        monitor = _monitor(log_interval=1, collectors=[EnergyCollector(world_size=world, uuid=f"GPU-{rank}")])
        monitor.step(1)
        clock.advance(1000 * (rank + 1))
        m = monitor.step(2)
    monitor.close()
    return {k: v for k, v in m.items() if k.startswith(("energy/", "power/"))}


def test_mean_power_is_each_gpus_over_its_own_ranks_interval():
    """Ranks whose intervals differ (arrival skew, a slow rank): the mean was the energy of all
    over the longest interval (30 J / 2 s / 2 GPUs: 7.5 W for two GPUs drawing 10 W)."""
    m = run_ranks(_intervals_that_differ, 2)[0]
    assert m["power/mean_w"] == pytest.approx(10.0)
    assert m["power/max_w"] == pytest.approx(10.0) and m["power/min_w"] == pytest.approx(10.0)
    assert m["energy/total_j"] == pytest.approx(30.0)


def _one_gpu_unmeasured(rank: int, world: int) -> dict:
    # rank 0's counter: built, first step, log step 2 (30 J over the one timed 1 s step); rank 1's
    # GPU has no counter (NOT_SUPPORTED)
    sys.modules["pynvml"] = fake_pynvml.make(devices={f"GPU-{rank}": [0, 0, 30_000]}, unsupported_energy=rank == 1)
    from distmetrics.collectors.nvml import EnergyCollector

    class Clock(FakeClock):
        MODULES = FakeClock.MODULES + ("distmetrics.collectors.nvml",)

    with Clock() as clock:
        monitor = _monitor(log_interval=2, collectors=[EnergyCollector(world_size=world, uuid=f"GPU-{rank}")])
        monitor.step(1, tokens=50)
        clock.advance(1000)
        m = monitor.step(2, tokens=50)
    monitor.close()
    return {k: v for k, v in m.items() if k.startswith(("energy/", "power/"))}


def test_a_gpu_without_the_counter_on_one_rank_is_not_counted_as_drawing_nothing():
    """Rank 1's GPU has no energy counter: its rank sent nothing, and the per-GPU values were
    divided by both GPUs (15 W mean power beside 30 W max and min, for the one GPU measured) and
    the job's total was presented as whole. Per GPU is per GPU measured; what needs every GPU
    (totals, energy per token) is left out, and the record says how many were measured."""
    results = run_ranks(_one_gpu_unmeasured, 2)
    assert results[0] == results[1]
    m = results[0]
    assert m["energy/gpus_measured"] == 1
    assert m["energy/j_per_gpu_per_step"] == pytest.approx(30.0)  # 30 J / 1 GPU / 1 timed step
    assert m["power/mean_w"] == pytest.approx(30.0) and m["power/max_w"] == pytest.approx(30.0)
    assert not [k for k in m if k in ("energy/total_j", "energy/job_total_j", "energy/j_per_token")]


def test_energy_of_every_gpu_lost_mid_run_is_said_in_the_record_as_none_measured(monkeypatch):
    """NVML failing on the only GPU at step 2: the records from there held no energy key at all, where one GPU
    of two lost writes energy/gpus_measured: 1. They write energy/gpus_measured: 0 (pynvml faked: no GPU here)."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make(devices={
        "GPU-0": [0, 0, 5000, fake_pynvml.NVMLError(15)]}))
    from distmetrics.collectors.nvml import EnergyCollector

    monitor = _monitor(log_interval=1, collectors=[EnergyCollector(world_size=1, uuid="GPU-0")])
    records = [monitor.step(step, tokens=1) for step in (1, 2, 3, 4)]
    monitor.close()
    assert "energy/total_j" in records[0] and "energy/gpus_measured" not in records[0], records[0]
    for record in records[1:]:
        assert {k: v for k, v in record.items() if k.startswith(("energy/", "power/"))} == \
            {"energy/gpus_measured": 0}, record


def _gpus_not_opened_on_some_ranks(rank: int, world: int, steps: tuple = (1, 2, 3)) -> dict:
    # rank 0's GPU has an energy counter; no rank's GPU is found for telemetry, rank 1's for nothing
    sys.modules["pynvml"] = fake_pynvml.make(devices={"GPU-0": [0, 0, 10_000, 20_000, 30_000]})
    import distmetrics as dm
    from distmetrics.collectors.nvml import EnergyCollector, TelemetryCollector

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    collectors = [EnergyCollector(world_size=world, uuid=f"GPU-{rank}"), TelemetryCollector(uuid="GPU-none")]
    records = []
    with dm.Monitor(quiet_config(log_interval=1), collectors=collectors) as monitor:
        for step in steps:
            records.append(monitor.step(step, tokens=10))
        if not steps:
            monitor.log_eval(1, loss=1.0, tokens=10)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"said": [line for line in said if "not measured" in line or "not collected" in line],
            "gpus_measured": records[-1].get("energy/gpus_measured") if records else None}


def test_a_gpu_not_opened_in_nvml_is_said_once_for_the_job_by_the_first_rank_concerned():
    """Every rank whose GPU NVML could not open said so when its collector was made: 4 identical
    lines with 4 ranks, 1,000 with 1,000. Once for the job now, at the first log step, by the lowest
    rank concerned (its own error), with how many ranks: energy on rank 1 only, telemetry on both."""
    out = run_ranks(_gpus_not_opened_on_some_ranks, 2, timeout=120)
    assert [result["gpus_measured"] for result in out] == [1, 1]
    assert out[0]["said"] == ["distmetrics: GPU telemetry is not collected (log_gpu_telemetry has no effect there) on "
                              "2 of the 2 ranks (rank 0, the first of them: NVMLError: NVML error 13). Said once, by "
                              "that rank"], out[0]
    assert len(out[1]["said"]) == 1, out[1]
    assert out[1]["said"][0].startswith("distmetrics: GPU energy is not measured (log_energy has no effect there")
    assert out[1]["said"][0].endswith(" on 1 of the 2 ranks (rank 1, the first of them: NVMLError: NVML error 13). "
                                      "Said once, by that rank"), out[1]


def test_a_gpu_not_opened_in_an_evaluation_only_job_is_said_at_close_by_each_rank_concerned():
    """With no log step, nothing reduced the lanes that say it for the job: it went unsaid. Each rank
    concerned says its own as it closes (no collective is left to say it once)."""
    out = run_ranks(_gpus_not_opened_on_some_ranks, 2, (), timeout=120)
    assert sorted(line.split(" (")[0] for line in out[0]["said"]) == ["distmetrics: GPU telemetry is not collected"]
    assert sorted(line.split(" (")[0] for line in out[1]["said"]) == ["distmetrics: GPU energy is not measured",
                                                                      "distmetrics: GPU telemetry is not collected"]
    assert all(line.endswith("(NVMLError: NVML error 13); no log step said it for the job")
               for result in out for line in result["said"]), out


def test_a_counter_that_goes_back_is_a_reset_not_a_wrap(nvml, caplog):
    """Readings 5,000,000 -> 5,040,000 -> 20,000 mJ (a driver reload reset the counter): read as a
    64-bit wrap, the interval held 1.8e16 J. The energy since the reset (20 J) is what is known."""
    nvml(devices={"GPU-0000": [5_000_000, 5_040_000, 20_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    caplog.set_level(logging.WARNING, logger="distmetrics")
    energy = EnergyCollector(world_size=1, uuid="GPU-0000")
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(40.0)
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(20.0)
    said = [r.getMessage() for r in caplog.records if "went back from 5040000 to 20000 mJ" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize("readings,joules", [
    ([1_000, 2_000, 5_000, 500], 1.5),  # reset after the pause: the 1 J before it, the 0.5 J since the reset
    ([1_000, 2_000, 100, 600], 1.5),  # reset during the pause: the 1 J before it, the 0.5 J after it
    ([1_000, 200, 300, 800], 0.7),  # reset before the pause: the 0.2 J since the reset, the 0.5 J after it
], ids=["after the pause", "during the pause", "before the pause"])
def test_a_counter_reset_in_an_interval_with_a_pause_counts_every_span_it_can(nvml, readings, joules):
    """Readings: start, pause, resume, log step (mJ). A reset after the pause subtracted the paused
    energy, read before the reset, from the reading after it: max(0, 500 - 3,000) = 0 J."""
    nvml(devices={"GPU-0000": readings})
    from distmetrics.collectors.nvml import EnergyCollector

    energy = EnergyCollector(world_size=1, uuid="GPU-0000")
    energy.pause()
    energy.resume()
    assert {s.name: s.value for s in energy.take_samples(_ctx())}["energy/total_j"] == pytest.approx(joules)


def test_the_first_record_at_log_interval_1_has_no_power_over_no_time(nvml):
    """At log_interval 1 the first monitor.step starts the count and logs at once: the record
    measured no step (README) yet held power/max_w = min_w = 0 W and j_per_gpu_per_step 0, or
    1,658 W when the counter ticked between the two reads."""
    nvml(devices={"GPU-0000": [0, 0, 100, 100_100]})
    from distmetrics.collectors.nvml import EnergyCollector

    monitor = _monitor(log_interval=1, collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
    first = monitor.step(1, tokens=10)
    assert not [k for k in first if k.startswith("power/") or k in ("energy/j_per_gpu_per_step", "energy/j_per_token")]
    assert first["energy/total_j"] == pytest.approx(0.1)
    second = monitor.step(2, tokens=10)
    assert second["energy/j_per_gpu_per_step"] == pytest.approx(100.0) and second["power/max_w"] > 0
    monitor.close()


def test_an_nvml_error_mid_run_turns_energy_off_with_a_warning(nvml, caplog):
    """An NVMLError at a log step's read raised out of monitor.step (on many ranks the others
    would wait at the next collective). One warning; no energy metrics from then on but the count of GPUs
    measured, none."""
    fake = nvml(devices={"GPU-0000": [0, 0, 10_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    caplog.set_level(logging.WARNING, logger="distmetrics")
    monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")])
    monitor.step(1, tokens=10)
    assert monitor.step(2, tokens=10)["energy/total_j"] == pytest.approx(10.0)
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda handle: (_ for _ in ()).throw(fake_pynvml.NVMLError(15))
    for step in (3, 4, 5, 6):
        m = monitor.step(step, tokens=10)
    assert {k: v for k, v in m.items() if k.startswith(("energy/", "power/"))} == {"energy/gpus_measured": 0}
    said = [r.getMessage() for r in caplog.records if "not measured from here on" in r.getMessage()]
    assert len(said) == 1 and "NVML error 15" in said[0]
    monitor.close()


def test_a_pause_open_at_the_first_step_ends_there_for_energy_as_for_every_clock(nvml):
    """pause(), the first monitor.step inside it, resume() 0.5 s later, step 2 1 s after step 1:
    energy left the 0.5 s out, the step clock and the step timer counted it (power/mean_w 150 W
    beside max 300 W on one GPU). Every clock counts from the first step: 300 J over 1 s."""
    # readings: built, pause, first step (the pause ends there), log step
    nvml(devices={"GPU-0000": [0, 0, 0, 300_000]})
    from distmetrics.collectors.nvml import EnergyCollector

    class Clock(FakeClock):
        MODULES = FakeClock.MODULES + ("distmetrics.collectors.nvml",)

    with Clock() as clock:
        monitor = _monitor(collectors=[EnergyCollector(world_size=1, uuid="GPU-0000")], timing_log_level=0)
        monitor.pause()
        monitor.step(1, tokens=10)
        clock.advance(500)
        monitor.resume()
        clock.advance(500)
        m = monitor.step(2, tokens=10)
    monitor.close()
    assert m["energy/total_j"] == pytest.approx(300.0)
    assert m["train/step_time_ms"] == pytest.approx(1000.0) and m["timers/step"] == pytest.approx(1000.0)
    assert m["power/mean_w"] == pytest.approx(300.0) and m["power/max_w"] == pytest.approx(300.0)


# --- throughput arithmetic ---------------------------------------------------------------------

def test_throughput_mfu_sol_eta_against_hand_computation(caplog):
    from distmetrics.collectors.throughput import ThroughputCollector

    from distmetrics.collectors.base import LogContext

    t = ThroughputCollector(world_size=4, flops_per_token=6e9, peak_tflops=989.0, total_steps=100,
                            sol_step_time_ms=100.0)
    m = {}
    t.finalize(m, LogContext(step=10, steps=10, layout=None, interval_s=2.0, tokens=1e6))
    assert m["train/step_time_ms"] == pytest.approx(200.0)
    assert m["train/tokens_per_sec"] == pytest.approx(5e5)
    assert m["train/tokens_per_sec_per_gpu"] == pytest.approx(1.25e5)
    assert m["train/tflops_per_gpu"] == pytest.approx(1e6 * 6e9 / 2.0 / 4 / 1e12)
    assert m["train/mfu_pct"] == pytest.approx(100 * 750.0 / 989.0)
    assert m["train/sol_pct"] == pytest.approx(50.0)
    assert m["train/eta_s"] == pytest.approx(90 * 0.2)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    t.peak_tflops = 500.0
    t.finalize({}, LogContext(step=20, steps=10, layout=None, interval_s=2.0, tokens=1e6))
    assert any("above 100%" in r.getMessage() for r in caplog.records)


def test_eta_counts_the_calls_left_when_steps_are_numbered_with_a_stride():
    """Steps numbered 2, 4, ..., 20 with total_steps 20, 100 ms a call: after step 4, eight calls (6 ... 20)
    are left, 0.8 s. The ETA multiplied the time per call by the step numbers left, 1.6 s."""
    import distmetrics as dm

    etas = {}
    with FakeClock() as clock, dm.Monitor(quiet_config(log_interval=4, log_throughput=True, total_steps=20)) as monitor:
        for step in range(2, 21, 2):
            clock.advance(100.0)
            metrics = monitor.step(step)
            if metrics:
                etas[step] = metrics["train/eta_s"]
    assert etas == pytest.approx({4: 0.8, 8: 0.6, 12: 0.4, 16: 0.2, 20: 0.0}), etas


def _megatron_flops_per_token(layers: int, hidden: int, seq: int, vocab: int, heads: int, ffn: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, the dense
    GPT branch: multi-head attention, no SwiGLU, no MoE, no MTP) over one sequence, per token,
    written out term by term as it reads: 3 (forward + backward) x 2 (multiply-add) x the GEMMs'
    sizes, and the core attention halved for the causal mask."""
    expansion, fma = 3, 2
    query = key = value = (hidden // heads) * heads  # kv_channels x heads (and query groups)
    attention = expansion * fma * (hidden * (query + key + value) + query * seq / 2 * 2 + query * hidden)
    mlp = expansion * fma * hidden * (ffn * 2)
    logits = expansion * fma * hidden * vocab
    return layers * (attention + mlp) + logits


@pytest.mark.parametrize("seq", [2048, 32768])
def test_flops_per_token_from_a_model_description_is_megatrons(seq):
    """With N the parameters of the matrix multiplies (Megatron counts the output layer, not the
    input embedding's lookup), the default (causal) description gives Megatron-LM's FLOPs; ``full``
    counts the whole attention matrix, as PaLM and torchtitan do (1.4x Megatron's at 32k)."""
    import distmetrics as dm

    layers, hidden, heads, vocab = 32, 4096, 32, 32000
    matmul_params = layers * (4 * hidden * hidden + 2 * hidden * 4 * hidden) + hidden * vocab
    megatron = _megatron_flops_per_token(layers, hidden, seq, vocab, heads, 4 * hidden)
    described = dict(num_params=matmul_params, num_layers=layers, hidden_size=hidden, seq_length=seq)
    assert dm.MetricsConfig(**described).resolved_flops_per_token == pytest.approx(megatron, rel=1e-12)
    full = dm.MetricsConfig(**described, attention_flops="full").resolved_flops_per_token
    assert full == pytest.approx(6 * matmul_params + 12 * layers * hidden * seq, rel=1e-12)
    with pytest.raises(dm.ConfigError, match=r"attention_flops='half': accepted values are 'causal', 'full'"):
        dm.MetricsConfig(**described, attention_flops="half")


def test_flops_per_token_from_a_model_description():
    import distmetrics as dm

    cfg = dm.MetricsConfig(num_params=7e9, num_layers=32, hidden_size=4096, seq_length=4096)
    assert cfg.resolved_flops_per_token == pytest.approx(6 * 7e9 + 6 * 32 * 4096 * 4096)
    moe = dm.MetricsConfig(num_params=47e9, num_active_params=13e9)
    assert moe.resolved_flops_per_token == pytest.approx(6 * 13e9)
    assert dm.MetricsConfig(flops_per_token=1.0, num_params=5.0).resolved_flops_per_token == 1.0


def test_peak_lookup_by_gpu_name_and_dtype():
    from distmetrics.collectors.throughput import peak_tflops_for

    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops_for("NVIDIA H100 NVL", "bf16") == 835.5  # it matched "H100": the SXM board's 989
    assert peak_tflops_for("NVIDIA H200 NVL", "fp8") == 1670.5
    assert peak_tflops_for("NVIDIA H200 NVL", "bf16") == 835.5  # torchtitan matches "H200": the SXM board's 989
    assert peak_tflops_for("NVIDIA H200", "fp8") == 1979.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_tflops_for("Some Future GPU", "bf16") is None
    # a key inside another GPU's name gave that GPU a peak not its own (GB200 read as B200)
    for other in ("NVIDIA GB200", "NVIDIA RTX A1000 6GB Laptop GPU", "NVIDIA A10G", "NVIDIA H100X"):
        assert peak_tflops_for(other, "bf16") is None, other
    assert peak_tflops_for("NVIDIA A10", "bf16") == 125.0 and peak_tflops_for("Tesla V100-SXM2-32GB", "fp16") == 125.0
    # a MIG instance's name holds the board's: its slice was given the whole board's peak (MFU 7x low at 1g)
    for mig in ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H100 MIG 7g.80gb"):
        assert peak_tflops_for(mig, "bf16") is None, mig


def test_a_gpu_without_a_known_peak_is_said_with_why_and_gets_no_mfu(monkeypatch, caplog):
    """The GPU's name comes from torch.cuda, which this machine lacks: ``is_available`` and
    ``get_device_name`` are replaced (the narrowest boundary). A MIG slice gets no peak, and the
    warning says it is a slice."""
    import torch

    import distmetrics as dm
    from distmetrics.collectors.throughput import resolve_peak_tflops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = dm.MetricsConfig(num_params=7e9)
    for name, peak, why in (("NVIDIA H100 80GB HBM3", 989.0, None), ("NVIDIA GB200", None, ""),
                            ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None, " (a MIG instance: a slice of the GPU's peak)")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, n=name: n)
        caplog.clear()
        assert resolve_peak_tflops(config) == peak, name
        said = [r.getMessage() for r in caplog.records if "no peak TFLOP/s" in r.getMessage()]
        assert said == ([] if why is None else
                        [f"distmetrics: no peak TFLOP/s known for {name!r}{why} in bf16; set peak_tflops for MFU"]), \
            said


def test_the_peak_compared_at_start_up_is_the_one_each_ranks_gpu_gives_where_mfu_is_computed(monkeypatch):
    """With peak_tflops unset each rank looks up its own GPU's peak: an H100 SXM rank and an H100 PCIe rank
    each computed another MFU. Start-up compares the peak a rank will use (torch.cuda replaced as above); GPUs
    of one peak compare equal, and without FLOPs per token (no MFU) the GPU is not compared. What is compared
    is what the numbers are computed from: 6000000 and 6e6 agree; keys that compute nothing are not compared
    (num_params under a given flops_per_token, dtype under a given peak, anything with log_throughput off)."""
    import torch

    import distmetrics as dm
    from distmetrics.collectors.throughput import shared_throughput

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def compared(name, **keys):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
        return shared_throughput(dm.MetricsConfig(**keys))

    sxm, pcie, h200 = (compared(name, num_params=7e9)["peak_tflops"]
                       for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200"))
    assert sxm == h200 == "989.0 looked up for this rank's GPU in bf16" and pcie.startswith("756.0 ")
    assert compared("NVIDIA GB200", num_params=7e9)["peak_tflops"] == "None looked up for this rank's GPU in bf16"
    assert compared("NVIDIA H100 PCIe")["peak_tflops"] is None
    assert compared("NVIDIA H100 PCIe", num_params=7e9, peak_tflops=5)["peak_tflops"] == 5.0
    h100 = "NVIDIA H100 80GB HBM3"
    assert compared(h100, flops_per_token=6000000) == compared(h100, flops_per_token=6e6, num_params=1e9) == \
        {"flops_per_token": 6e6, "peak_tflops": sxm, "sol_step_time_ms": None}
    assert compared(h100, flops_per_token=6e6, peak_tflops=900, dtype="fp8") == \
        compared(h100, flops_per_token=6e6, peak_tflops=900.0, dtype="bf16", sol_step_time_ms=None)
    assert compared(h100, num_params=1e9, log_throughput=False, sol_step_time_ms=5) == \
        compared(h100, num_params=2e9, log_throughput=False) == dict.fromkeys(
            ("flops_per_token", "peak_tflops", "sol_step_time_ms"))


# --- progress.txt -----------------------------------------------------------------------------

def test_progress_txt_is_cumulative_across_a_restart_with_the_same_world_size(tmp_path):
    import distmetrics as dm
    from distmetrics.sinks.progress import progress_line

    now = dt.datetime.now().replace(microsecond=0)
    first_start = now - dt.timedelta(hours=2)
    old = [
        progress_line("Starting job", 8, "1", first_start - dt.timedelta(hours=5)),  # other world size
        progress_line("Saved checkpoint\tIteration: 50\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: "
                      "1.0 TFLOP/s/GPU\tFloating-point operations: 1.00e+15\tTokens (in billions): 0.20",
                      8, "1", first_start - dt.timedelta(hours=4)),
        progress_line("Starting job", 1, "2", first_start),
        progress_line("Saved checkpoint\tIteration: 100\tJob throughput: 2.0 TFLOP/s/GPU\tCumulative throughput: "
                      "2.0 TFLOP/s/GPU\tFloating-point operations: 3.60e+15\tTokens (in billions): 0.50",
                      1, "2", now - dt.timedelta(hours=1)),
    ]
    (tmp_path / "progress.txt").write_text("".join(old))
    flops_per_token = 1e9
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False,
                                          tensorboard=False, flops_per_token=flops_per_token, timing_log_level=-1))
    for step in (101, 102, 103, 104):
        monitor.step(step, loss=1.0, tokens=1000)
    monitor.checkpoint_saved(104)
    monitor.close()
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert lines[-2].endswith("# GPUs: 1\tStarting job")
    fields = lines[-1].split("\t")
    assert fields[1:5] == ["Job ID: ", "# GPUs: 1", "Saved checkpoint", "Iteration: 104"]
    flops = 3.6e15 + 4000 * flops_per_token
    assert float(fields[7].split(": ")[1]) == pytest.approx(flops, rel=5e-3)
    assert fields[8] == f"Tokens (in billions): {(0.5e9 + 4000) / 1e9:.2f}"
    # cumulative: flops since the first start of this world size's streak (which began at
    # 1.00e+15 flops, the last checkpoint before it), over the time since then
    cumulative = float(fields[6].split(": ")[1].split()[0])
    expected = (flops - 1.0e15) / (2 * 3600) / 1e12
    assert cumulative == pytest.approx(expected, abs=0.06)
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"][0]
    assert record["checkpoint/floating_point_operations"] == pytest.approx(flops)
    assert record["checkpoint/cumulative_tflops_per_gpu"] == pytest.approx(expected, rel=1e-2)
    assert math.isfinite(record["checkpoint/job_tflops_per_gpu"])


def test_host_rss_is_read_from_procfs_as_psutil_reads_it_and_from_psutil_without_procfs(monkeypatch):
    import os

    import psutil

    from distmetrics.collectors.memory import _RssReader

    reader = _RssReader()
    assert reader._fd is not None  # Linux: one pread of /proc/<pid>/statm per log step
    ballast = b"x" * (64 << 20)
    assert reader.read() == pytest.approx(psutil.Process().memory_info().rss, rel=0.02)
    assert reader.read() / 2 ** 20 > 64
    reader.close()
    assert reader.read() == pytest.approx(psutil.Process().memory_info().rss, rel=0.02)  # still answers

    def no_procfs(*args, **kwargs):
        raise FileNotFoundError("/proc")

    monkeypatch.setattr(os, "open", no_procfs)
    fallback = _RssReader()
    assert fallback._fd is None and fallback.read() == pytest.approx(psutil.Process().memory_info().rss, rel=0.02)
    del ballast


def test_checkpoint_tokens_and_flops_carry_across_a_restart_exactly(tmp_path):
    """progress.txt rounds the tokens to 0.01 billion and the FLOPs to three digits; a restart
    takes the last checkpoint's exact numbers from metrics.jsonl (4M + 4M tokens, not 0 + 4M)."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=1,
                           flops_per_token=6.789e9, timing_log_level=-1, log_memory=False, straggler_window=0)
    for first in (1, 11):  # two jobs of 10 steps, 400k tokens each, a checkpoint at the end of each
        with dm.Monitor(cfg) as monitor:
            for step in range(first, first + 10):
                monitor.step(step, loss=1.0, tokens=400_000)
            monitor.checkpoint_saved(first + 9)
    saved = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"]
    assert [r["checkpoint/tokens"] for r in saved] == [4e6, 8e6]
    assert saved[1]["checkpoint/floating_point_operations"] == pytest.approx(8e6 * 6.789e9, rel=1e-12)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert lines[-1].endswith("Tokens (in billions): 0.01") and "Floating-point operations: 5.43e+16" in lines[-1]


def _progress_jobs(tmp_path, jobs, before_second=None, zero_based=False, save_first=None):
    """Jobs of (first step, last step, steps with a checkpoint); 1,000 tokens a step; the progress
    records of metrics.jsonl. ``zero_based``: the loop counts steps from 0 and saves after step s
    as checkpoint s + 1 (steps done). ``save_first``: the second job saves that checkpoint before
    its first step."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=10,
                           flops_per_token=1e9, timing_log_level=-1, log_memory=False, straggler_window=0)
    for n, (first, last, checkpoints) in enumerate(jobs):
        if n == 1 and before_second is not None:
            before_second(tmp_path / "progress.txt")
        with dm.Monitor(cfg) as monitor:
            if n == 1 and save_first is not None:
                monitor.checkpoint_saved(save_first)
            for step in range(first, last + 1):
                monitor.step(step, loss=1.0, tokens=1000)
                done = step + 1 if zero_based else step
                if done in checkpoints:
                    monitor.checkpoint_saved(done)
    return [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"]


@pytest.mark.parametrize("rollback", [False, True], ids=["from the last checkpoint", "from an older one"])
@pytest.mark.parametrize("zero_based", [False, True], ids=["steps from 1", "steps from 0"])
def test_a_restart_counts_flops_and_tokens_on_from_the_checkpoint_it_resumed_from(tmp_path, rollback, zero_based):
    """Megatron counts FLOPs and tokens on from the checkpoint it loads. Job 1 saves at 100 and
    200; job 2 resumes from 200 (steps 201-300) or rolls back to 100 (steps 101-200, as after a
    loss spike): its checkpoint's numbers are 1,000 tokens per step since step 0, exactly, not
    the last line's plus this job's (3e14 FLOPs at step 200 after the rollback). The same for a
    loop that counts steps from 0 and saves after step s as checkpoint s + 1, and for a job that
    saves its checkpoint again before its first step."""
    first, last = (101, 200) if rollback else (201, 300)
    shift = 1 if zero_based else 0
    saved = _progress_jobs(tmp_path, [(1 - shift, 200 - shift, (100, 200)), (first - shift, last - shift, (last,))],
                           zero_based=zero_based, save_first=first - 1)
    assert [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"]) for r in saved] == [
        (100, 1e5, 1e14), (200, 2e5, 2e14), (first - 1, (first - 1) * 1000.0, (first - 1) * 1e12),
        (last, last * 1000.0, last * 1e12)]
    line = (tmp_path / "progress.txt").read_text().splitlines()[-1]
    assert f"Iteration: {last}\t" in line and f"Floating-point operations: {last * 1e12:.2e}" in line


def test_a_job_without_a_flops_description_writes_unknown_flops_not_zeros(tmp_path):
    """Job 1 has no model description: its "Saved checkpoint" line says nan for the throughputs and
    FLOPs (Megatron's readers parse it), its progress record leaves them out, and the tokens are
    exact (0 TFLOP/s and 0 FLOPs read as measured). Job 2 has one: its own throughput is known;
    its FLOPs and cumulative throughput, which count on from job 1's unknown FLOPs, are not."""
    import distmetrics as dm
    from distmetrics.sinks.progress import read_progress

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=10,
                           timing_log_level=-1, log_memory=False, straggler_window=0)
    for first, flops_per_token in ((1, None), (11, 1e9)):
        with dm.Monitor(cfg.replace(flops_per_token=flops_per_token)) as monitor:
            for step in range(first, first + 10):
                monitor.step(step, loss=1.0, tokens=1000)
            monitor.checkpoint_saved(first + 9)
    first, second = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"]
    assert {k for k in first if k.startswith("checkpoint/")} == {"checkpoint/tokens"}
    assert first["checkpoint/tokens"] == 10_000 and second["checkpoint/tokens"] == 20_000
    assert second["checkpoint/job_tflops_per_gpu"] > 0
    assert "checkpoint/floating_point_operations" not in second
    assert "checkpoint/cumulative_tflops_per_gpu" not in second
    lines = [line for line in (tmp_path / "progress.txt").read_text().splitlines() if "Saved checkpoint" in line]
    assert ("Job throughput: nan TFLOP/s/GPU\tCumulative throughput: nan TFLOP/s/GPU\t"
            "Floating-point operations: nan\t") in lines[0]
    assert "Job throughput: nan" not in lines[1] and "Floating-point operations: nan\t" in lines[1]
    saved = read_progress(tmp_path / "progress.txt", 1)["saved"]
    assert [line.iteration for line in saved] == [10, 20] and all(math.isnan(line.flops) for line in saved)


def _checkpoints_of_jobs_that_count_no_tokens(rank: int, world: int, root: str) -> dict:
    """Jobs of steps 1-4 and a checkpoint at 4 (flops_per_token set): no tokens= anywhere; tokens on
    pipeline rank 0 only, where the last stage (rank 1) counts them; tokens=0 everywhere. Then a job
    resuming the first at step 5 with 1,000 tokens a step on every rank, saving at 6."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    import logging

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    cfg = quiet_config(log_interval=2, json_log=True, log_progress=True, flops_per_token=1e9)
    tokens = {"no tokens": lambda: None, "first stage only": lambda: 1000 if rank == 0 else None, "zero": lambda: 0}
    for case, given in tokens.items():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)) if case == "first stage only" else None
        with dm.Monitor(cfg.replace(output_dir=f"{root}/{case}"), device_mesh=mesh) as monitor:
            for step in range(1, 5):
                monitor.step(step, loss=1.0, tokens=given())
            monitor.checkpoint_saved(4)
    with dm.Monitor(cfg.replace(output_dir=f"{root}/no tokens")) as monitor:
        for step in (5, 6):
            monitor.step(step, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(6)
    logging.getLogger("distmetrics").removeHandler(handler)
    if rank != 0:
        return {}
    out = {case: ([r for r in dm.read_jsonl(f"{root}/{case}/metrics.jsonl") if r["kind"] == "progress"],
                  [line for line in Path(root, case, "progress.txt").read_text().splitlines()
                   if "Saved checkpoint" in line])
           for case in tokens}
    out["said"] = [line for line in said if "checkpoint_saved(" in line and "not known" in line]
    return out


def test_a_job_in_which_no_rank_counts_tokens_writes_unknown_tokens_and_flops_not_zeros(tmp_path):
    """No rank counted a token (none given, or given only on a pipeline rank that does not count them):
    the checkpoint wrote 0 FLOPs, 0.0 TFLOP/s/GPU and 0 tokens though flops_per_token is set, and a
    restart counted on from 0. Not known: nan in the line, left out of the record, and unknown in a job
    that counts on from it (its own throughput known); a job that passed tokens=0 counted 0."""
    (result,) = [r for r in run_ranks(_checkpoints_of_jobs_that_count_no_tokens, 2, str(tmp_path), timeout=180) if r]
    for case in ("no tokens", "first stage only"):
        records, lines = result[case]
        first = records[0]
        assert first["step"] == 4 and not any(k.startswith("checkpoint/") for k in first), (case, first)
        assert lines[0].endswith("Job throughput: nan TFLOP/s/GPU\tCumulative throughput: nan TFLOP/s/GPU\t"
                                 "Floating-point operations: nan\tTokens (in billions): nan"), (case, lines[0])
    resumed = result["no tokens"][0][1]  # counts on from an unknown total
    assert resumed["step"] == 6 and resumed["checkpoint/job_tflops_per_gpu"] > 0, resumed
    assert {k for k in resumed if k.startswith("checkpoint/")} == {"checkpoint/job_tflops_per_gpu"}, resumed
    (zero,), _ = result["zero"]
    assert zero["checkpoint/tokens"] == 0.0 and zero["checkpoint/floating_point_operations"] == 0.0, zero
    assert [line.split(":")[1] for line in result["said"]] == [" monitor.checkpoint_saved(4)"] * 2 + [
        " monitor.checkpoint_saved(6)"], result["said"]  # the resumed job counts on from an unknown total


@pytest.mark.parametrize("checkpoints", [(10, 20), (20,)], ids=["a line before it", "its only line"])
def test_a_checkpoint_line_lost_from_progress_txt_is_counted_on_from_metrics_jsonl(tmp_path, caplog, checkpoints):
    """The disk filled between a checkpoint's JSONL record and its progress.txt line: a job
    resuming from that checkpoint counted on from the line before it (tokens 10k short at step
    30), or from 0 where it was the only one. The record in metrics.jsonl is taken instead, with a
    warning."""
    import logging

    caplog.set_level(logging.WARNING, logger="distmetrics")

    def lose_the_last_line(path):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:-1]))  # "Saved checkpoint ... Iteration: 20" never written

    saved = _progress_jobs(tmp_path, [(1, 20, checkpoints), (21, 30, (30,))], before_second=lose_the_last_line)
    assert [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"]) for r in saved] == [
        (c, c * 1e3, c * 1e12) for c in checkpoints] + [(30, 3e4, 3e13)]
    assert any("no \"Saved checkpoint\" line for iteration 20" in r.getMessage() for r in caplog.records)



def test_a_lost_line_of_a_checkpoint_saved_again_after_a_rollback_is_counted_on_from_its_record(tmp_path, caplog):
    """Job a saved 10 and 20; job b rolled back to 10 and saved 20 again with other numbers (twice a's
    tokens a step), and that line was lost (its metrics.jsonl record was written); job c resumes from
    20. progress.txt's line of iteration 20 is a's, whose numbers the record does not round to: c
    counted on from a's text (FLOPs 3e13 for 5e13, tokens 10k for 50k: the text's 0.00 billion)
    without a word. The record comes after a's own record of 20 in metrics.jsonl: it is the later
    save, and is taken, with the warning."""
    import logging

    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=10,
                           flops_per_token=1e9, timing_log_level=-1, log_memory=False, straggler_window=0)
    for first, last, tokens in ((1, 20, 1000), (11, 20, 3000), (21, 30, 1000)):
        if first == 21:  # b's "Saved checkpoint ... Iteration: 20" never written
            progress = tmp_path / "progress.txt"
            progress.write_text("".join(progress.read_text().splitlines(keepends=True)[:-1]))
        with dm.Monitor(cfg) as monitor:
            for step in range(first, last + 1):
                monitor.step(step, loss=1.0, tokens=tokens)
                if step % 10 == 0:
                    monitor.checkpoint_saved(step)
    saved = [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"])
             for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"]
    assert saved == [(10, 1e4, 1e13), (20, 2e4, 2e13), (20, 4e4, 4e13), (30, 5e4, 5e13)]  # 1,000 or 3,000 a step
    assert "no \"Saved checkpoint\" line for iteration 20" in caplog.text
    assert "Floating-point operations: 5.00e+13" in (tmp_path / "progress.txt").read_text().splitlines()[-1]

def test_a_checkpoint_lost_from_both_files_is_said_when_a_job_resumes_after_it(tmp_path, caplog):
    """The disk filled after checkpoint 10: checkpoint 20's progress.txt line and its JSONL record
    were both lost, and a job resuming from it (first step 21) counted on from checkpoint 10's
    numbers, 10k tokens short at step 30, without a word. Which numbers it lost cannot be known;
    that they are short is said. A job resuming right after a known checkpoint says nothing."""
    import logging

    caplog.set_level(logging.WARNING, logger="distmetrics")

    def lose_checkpoint_20(path):
        for name in ("progress.txt", "metrics.jsonl"):
            lines = (path.parent / name).read_text().splitlines(keepends=True)
            (path.parent / name).write_text("".join(line for line in lines if not (
                "Iteration: 20\t" in line or ('"kind":"progress"' in line and '"step":20,' in line))))

    saved = _progress_jobs(tmp_path, [(1, 20, (10, 20)), (21, 30, (30,))], before_second=lose_checkpoint_20)
    assert [(r["step"], r["checkpoint/tokens"]) for r in saved] == [(10, 1e4), (30, 2e4)]
    said = [r.getMessage() for r in caplog.records if "have no checkpoint after iteration" in r.getMessage()]
    assert len(said) == 1 and "after iteration 10, and this job started at step 21" in said[0], said
    caplog.clear()
    _progress_jobs(tmp_path / "whole", [(1, 20, (10, 20)), (21, 30, (30,))])
    assert not [r for r in caplog.records if "have no checkpoint after" in r.getMessage()]
    import distmetrics as dm  # a job that saves no checkpoint (it only evaluates) counts nothing: says nothing

    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False)) as monitor:
        monitor.log_eval(25, loss=1.0)
    assert not [r for r in caplog.records if "have no checkpoint after" in r.getMessage()]


def test_a_job_with_no_checkpoint_line_reads_only_the_end_of_metrics_jsonl(tmp_path, monkeypatch):
    """Looking for a checkpoint whose only progress.txt line was lost reads the end of
    metrics.jsonl, not all of it (1.5 s a gigabyte here, at every restart of a job that saves no
    checkpoint); with a line, the search is for a record after it and ends there."""
    import json

    from distmetrics import checkpoints
    from distmetrics.runlog import last_record

    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "progress", "step": 20, "checkpoint/tokens": 2e4}] + \
            [{"kind": "train", "step": s, "train/loss": 1.0} for s in range(21, 2021)]
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    size = path.stat().st_size
    found = last_record(path, lambda r: r["kind"] == "progress", starts=b'{"kind":"progress"')
    assert found["step"] == 20
    assert last_record(path, lambda r: r["kind"] == "progress", starts=b'{"kind":"progress"', within=size // 2) is None
    # a restart whose progress.txt has no line searches only that far back
    monkeypatch.setattr(checkpoints, "_NO_LINE_WITHIN", 100)

    def lose_the_last_line(progress):
        progress.write_text("".join(progress.read_text().splitlines(keepends=True)[:-1]))

    saved = _progress_jobs(tmp_path / "run", [(1, 20, (20,)), (21, 30, (30,))], before_second=lose_the_last_line)
    assert saved[-1]["checkpoint/tokens"] == 1e4  # the record of 20 was further back than 100 bytes


def test_a_torn_last_line_of_progress_txt_is_not_read(tmp_path):
    """A crash during the write of a "Saved checkpoint" line leaves it cut short: 'Tokens (in' with
    no number made the next Monitor() raise IndexError, 'Tokens (in billions): 1' (of 12.34)
    counted 1 billion tokens. The torn line is left out (and cut off the file): the next job
    counts on from the last whole line."""
    def tear(cut):
        def before_second(path):
            with open(path, "a") as f:
                f.write("2026-11-26 08:00:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 150\t"
                        "Job throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t"
                        f"Floating-point operations: 9.99e+19\t{cut}")
        return before_second

    for n, cut in enumerate(("Tokens (in", "Tokens (in billions): 1")):
        out = tmp_path / str(n)
        saved = _progress_jobs(out, [(1, 100, (100,)), (151, 200, (200,))], before_second=tear(cut))
        assert [(r["step"], r["checkpoint/tokens"]) for r in saved] == [(100, 1e5), (200, 1.5e5)], cut
        assert "9.99e+19" not in (out / "progress.txt").read_text()


def _mfu_above_100(rank: int, world: int) -> list:
    import logging

    import distmetrics as dm

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    with FakeClock() as clock:
        with dm.Monitor(quiet_config(log_interval=1, log_throughput=True, flops_per_token=1e12, peak_tflops=1.0)) as m:
            for step in (1, 2, 3):
                clock.advance(1000)
                m.step(step, tokens=1000)
    return [w for w in seen if "is above 100%" in w]


def test_mfu_above_100_is_said_once_per_job_not_once_per_rank():
    """Every rank computes the same MFU: each said it, 1,000 warnings on 1,000 ranks."""
    said = run_ranks(_mfu_above_100, 2, timeout=90)
    assert len(said[0]) == 1 and said[1] == []
    assert "peak_tflops=1 or flops_per_token=1e+12" in said[0][0], said  # a peak below 0.05 read 0.0


def _a_step_without_tokens(rank: int, world: int, never: bool = False) -> dict:
    # 100 ms a step, 100 tokens on rank 0 and 50 on rank 1 at every step but step 3, where rank 1
    # passes tokens=None; both GPUs draw 10 J an interval (readings: built, first step, log steps).
    # ``never``: rank 0 is given no tokens at any step (a stage before the last, the Monitor told no `pp`)
    sys.modules["pynvml"] = fake_pynvml.make(devices={f"GPU-{rank}": [0, 0, 10_000, 20_000]})
    import distmetrics as dm
    from distmetrics.collectors.nvml import EnergyCollector

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    records = {}
    config = quiet_config(log_interval=4, log_throughput=True, flops_per_token=1e9, peak_tflops=1.0)
    with FakeClock() as clock:
        with dm.Monitor(config, collectors=[EnergyCollector(world_size=world, uuid=f"GPU-{rank}")]) as monitor:
            for step in range(1, 9):
                clock.advance(100)
                tokens = None if (rank, step) == (1, 3) and not never else 100 if rank == 0 else 50
                tokens = None if never and rank == 0 else tokens
                records[step] = monitor.step(step, tokens=tokens)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"records": {step: records[step] for step in (4, 8)},
            "said": [line for line in said if "tokens=None" in line]}


def _stalls_on_one_rank(rank: int, world: int) -> dict:
    """Real sleeps, no collective between log steps (every 2nd step): rank 1's first step takes 1 s (a
    warm-up) and its step 5 1.5 s; every other step 10 ms on both ranks. Each rank notes when each log
    step returned: the ranks leave its reduction together."""
    import time

    import distmetrics as dm

    returned, records = {}, {}
    with dm.Monitor(quiet_config(log_interval=2, log_throughput=True)) as monitor:
        for step in range(1, 11):
            time.sleep({(1, 1): 1.0, (1, 5): 1.5}.get((rank, step), 0.01))
            metrics = monitor.step(step, tokens=100)
            if metrics is not None:
                returned[step], records[step] = time.perf_counter(), metrics["train/step_time_ms"]
    return {"returned": returned, "records": records}


def test_a_wait_at_a_log_step_is_not_counted_again_in_the_next_interval():
    """Each rank's clock started its next interval as it took its samples, before the reduction: the rank
    that arrived first counted its wait there for the last one in its next interval, and the max over the
    ranks made it the job's step time. Rank 1's warm-up (no step's time) read as 500 ms steps in the record
    after the first, and its one slow step 5 as 750 ms steps twice (steps 5-6 and 7-8), with 10 ms steps
    around it: the records added up to twice the wall time. The truth: the time between two log steps'
    returns, which every rank leaves together."""
    out = run_ranks(_stalls_on_one_rank, 2, timeout=120)
    records, returned = out[0]["records"], out[0]["returned"]
    assert out[1]["records"] == records and sorted(records) == [2, 4, 6, 8, 10]
    truth = {step: (returned[step] - returned[step - 2]) * 1000 / 2 for step in (4, 6, 8, 10)}
    assert truth[6] > 700 and records[6] == pytest.approx(truth[6], rel=0.2), (records, truth)
    for step in (2, 4, 8, 10):  # 10 ms steps (a log step's own time and a loaded machine's delays on top)
        assert records[step] < 150, (step, records, truth)
    wall = (returned[10] - returned[2]) * 1000  # the records of steps 4-10 cover it all, once
    assert 2 * sum(records[step] for step in (4, 6, 8, 10)) == pytest.approx(wall, rel=0.15), (records, truth)


def test_throughput_of_an_interval_with_a_step_given_no_tokens_is_left_out_and_said():
    """Step 3 had tokens=None on rank 1: the record of step 4 divided the tokens given (400) by the
    time of every timed step (0.3 s), 1,333 tokens/s where the steps ran at 1,500 (MFU and energy per
    token alike), without a word. Those steps' tokens are not known: what divides them is left out,
    said once by the first rank, naming rank 1; a record whose steps all gave tokens has them all."""
    out = run_ranks(_a_step_without_tokens, 2, timeout=120)
    assert out[0]["records"] == out[1]["records"]
    first, second = out[0]["records"][4], out[0]["records"][8]
    derived = ("train/tokens_per_sec", "train/tokens_per_sec_per_gpu", "train/tflops_per_gpu", "train/mfu_pct",
               "energy/j_per_token")
    assert not [name for name in derived if name in first], first
    assert first["train/step_time_ms"] == pytest.approx(100.0) and first["train/consumed_tokens"] == 100 * 4 + 50 * 3
    tokens_per_sec = (100 + 50) / 0.1  # every step of the second interval: 150 tokens in 100 ms
    assert second["train/tokens_per_sec"] == pytest.approx(tokens_per_sec)
    assert second["train/tokens_per_sec_per_gpu"] == pytest.approx(tokens_per_sec / 2)
    assert second["train/mfu_pct"] == pytest.approx(100 * tokens_per_sec / 2 * 1e9 / 1e12 / 1.0)
    assert second["energy/j_per_token"] == pytest.approx(2 * 10.0 / (4 * 150))
    assert len(out[0]["said"]) == 1 and out[1]["said"] == [], out
    assert "left out of the record of step 4" in out[0]["said"][0]
    assert "rank 1 passed tokens=None at 1 of the 3 steps timed in it" in out[0]["said"][0]


def test_a_rank_never_given_tokens_leaves_the_throughput_of_the_ranks_given_them():
    """A rank given no tokens at any step (a pipeline stage before the last, where the Monitor is
    told no `pp` mesh) lacks none: its peers' tokens are the job's, as before, and nothing is said."""
    out = run_ranks(_a_step_without_tokens, 2, True, timeout=120)
    for step in (4, 8):
        assert out[0]["records"][step]["train/tokens_per_sec"] == pytest.approx(50 / 0.1), out[0]["records"][step]
    assert out[0]["said"] == out[1]["said"] == []


def _throughput_in_a_subgroup(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import distmetrics as dm

    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    metrics = None
    with FakeClock() as clock:
        with dm.Monitor(quiet_config(log_interval=2, log_throughput=True, flops_per_token=1e9, hang_timeout_s=0),
                        group=groups[rank]) as monitor:
            for step in (1, 2, 3):
                clock.advance(1000)
                metrics = monitor.step(step, tokens=1000) or metrics
    return metrics


def test_per_gpu_throughput_under_a_subgroup_is_over_the_groups_gpus():
    """A Monitor given a one-rank group sums that group's tokens: divided by the world's 2 GPUs,
    tokens/s per GPU read 500 for 1,000 (and TFLOP/s per GPU and MFU half)."""
    for m in run_ranks(_throughput_in_a_subgroup, 2, timeout=90):
        assert m["train/tokens_per_sec"] == pytest.approx(1000.0)
        assert m["train/tokens_per_sec_per_gpu"] == pytest.approx(1000.0)
        assert m["train/tflops_per_gpu"] == pytest.approx(1000.0 * 1e9 / 1e12)


STAGE_SHAPES = {0: (4, 8), 1: (8, 2)}
"""Two pipeline stages holding different parameter counts: Linear(4, 8) (40) and Linear(8, 2) (18)."""


def _throughput_keys_on_two_stages(rank: int, world: int) -> dict:
    """On a 2-stage pipeline (one rank a stage): Monitors given throughput keys that differ between the ranks
    (each stage's own parameter count; flops_per_token, peak_tflops, dtype and sol_step_time_ms on rank 0 only),
    then one given the whole model's count, which steps 1-4 (1 s and 1,000 tokens a step)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    stage = torch.nn.Linear(*STAGE_SHAPES[rank])
    local = sum(p.numel() for p in stage.parameters())
    counts: list = [None] * world
    dist.all_gather_object(counts, local)
    base = quiet_config(log_interval=2, log_throughput=True)
    differing = {"own stage count": dict(num_params=float(local), peak_tflops=1.0),
                 "set on rank 0 only": dict(flops_per_token=1e6, peak_tflops=1.0, dtype="fp8", sol_step_time_ms=50.0)
                 if rank == 0 else {}}
    out: dict = {"counts": counts}
    for case, keys in differing.items():
        try:
            dm.Monitor(base.replace(**keys), device_mesh=mesh).close()
            out[case] = "made"
        except ValueError as err:
            out[case] = str(err)
    metrics = []
    with FakeClock() as clock:
        with dm.Monitor(base.replace(num_params=float(sum(counts)), peak_tflops=1e-9, sol_step_time_ms=250.0),
                        device_mesh=mesh) as monitor:
            for step in range(1, 5):
                clock.advance(1000)
                found = monitor.step(step, loss=1.0, tokens=1000)
                if found is not None:
                    metrics.append({k: v for k, v in found.items() if k.startswith("train/")})
    out["metrics"] = metrics
    return out


def test_throughput_keys_that_differ_between_ranks_are_refused_and_mfu_counts_the_whole_pipeline():
    """flops_per_token on rank 0 only gave rank 0 TFLOP/s and MFU and rank 1 neither: monitor.step returned
    another dict on each rank, and a writer_rank "last" wrote no MFU. A pipeline stage given its own
    parameter count computed its own MFU. Such keys are refused at start-up on every rank; the whole model's
    count on every rank gives each the same MFU: 1,000 tokens through both stages, 6·(40 + 18) FLOPs each,
    over 2 GPUs and 1 s."""
    results = run_ranks(_throughput_keys_on_two_stages, 2, timeout=120)
    for result in results:
        assert result["counts"] == [40, 18]
        assert "config key flops_per_token differs between ranks (240.0 on rank 0; 108.0 on rank 1)" in \
            result["own stage count"], result["own stage count"]  # 6·40 and 6·18, from num_params
        refused = result["set on rank 0 only"]
        for said in ("flops_per_token differs between ranks (1000000.0 on rank 0; None on rank 1)",
                     "peak_tflops differs between ranks (1.0 on rank 0; None on rank 1)",
                     "sol_step_time_ms differs between ranks (50.0 on rank 0; None on rank 1)"):
            assert f"config key {said}; every rank must be given the same value" in refused, refused
    first, second = results[0]["metrics"], results[1]["metrics"]
    assert first == second and len(first) == 2  # the same dict on every rank, at steps 2 and 4
    tflops = 1000 * 6.0 * (40 + 18) / 1.0 / 2 / 1e12
    for metrics in first:
        assert metrics["train/tokens_per_sec"] == pytest.approx(1000.0)  # counted once, on the last stage
        assert metrics["train/tflops_per_gpu"] == pytest.approx(tflops, rel=1e-12)
        assert metrics["train/mfu_pct"] == pytest.approx(100.0 * tflops / 1e-9, rel=1e-12)
        assert metrics["train/sol_pct"] == pytest.approx(25.0)


def _two_steps_and_a_checkpoint(folder, first: int, flops_per_token: float) -> dict:
    """A job of steps ``first`` and ``first + 1`` (1,000 tokens each) saving a checkpoint after them
    in ``folder``: its ``progress`` record."""
    import distmetrics as dm

    with dm.Monitor(dm.MetricsConfig(output_dir=str(folder), log_interval=2, console=False, tensorboard=False,
                                     flops_per_token=flops_per_token, timing_log_level=-1)) as monitor:
        for step in (first, first + 1):
            monitor.step(step, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(first + 1)
    (record,) = [r for r in dm.read_jsonl(folder / "metrics.jsonl") if r["kind"] == "progress"]
    return record


def _saved_line(iteration, flops, tokens_b, world, when):
    """A "Saved checkpoint" line of progress.txt as Megatron writes it (tokens in billions)."""
    from distmetrics.sinks.progress import progress_line

    return progress_line(f"Saved checkpoint\tIteration: {iteration}\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative "
                         f"throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\tTokens (in "
                         f"billions): {tokens_b:.2f}", world, "1", when)


@pytest.mark.parametrize("b_saved", [True, False], ids=["B saved", "B saved nothing"])
def test_a_streak_that_began_with_a_rollback_counts_its_flops_from_the_checkpoint_it_loaded(tmp_path, b_saved):
    """Job A (8 GPUs) saved 10 and 20; job B (1 GPU, a new streak) rolled back to 10 and saved 20 and
    30; job C (1 GPU) resumes from B's 30. The streak's FLOPs were counted from the last line before
    B's "Starting job" (A's 20: 2e10), not from the checkpoint B loaded (1e10): C's cumulative
    throughput was negative. Where B saved nothing, C itself rolls back to 10 and the streak counts
    from there (it was negative too). The lines are Megatron's, written as B would have."""
    from distmetrics.sinks.progress import progress_line

    now = dt.datetime.now().replace(microsecond=0)
    b_start = now - dt.timedelta(hours=1)

    (tmp_path / "progress.txt").write_text("".join([
        progress_line("Starting job", 8, "1", b_start - dt.timedelta(hours=3)),
        _saved_line(10, 1e16, 10.0, 8, b_start - dt.timedelta(hours=2)),
        _saved_line(20, 2e16, 20.0, 8, b_start - dt.timedelta(hours=1)),
        progress_line("Starting job", 1, "1", b_start)] + ([
            _saved_line(20, 1.3e16, 13.0, 1, b_start + dt.timedelta(minutes=20)),
            _saved_line(30, 1.6e16, 16.0, 1, b_start + dt.timedelta(minutes=40))] if b_saved else [])))
    flops_per_token = 1e6
    first = 31 if b_saved else 11
    record = _two_steps_and_a_checkpoint(tmp_path, first, flops_per_token)
    flops = (1.6e16 if b_saved else 1e16) + 2000 * flops_per_token
    assert record["checkpoint/floating_point_operations"] == pytest.approx(flops)
    expected = (flops - 1e16) / 3600 / 1e12  # since B started, from the 1e16 of the checkpoint it loaded
    assert record["checkpoint/cumulative_tflops_per_gpu"] == pytest.approx(expected, rel=1e-2)


def test_the_first_jobs_cumulative_throughput_counts_from_its_starting_line_as_megatron_reads_it():
    """Megatron reads a streak's start from its "Starting job" line, to the second, in the first job too; the
    first job counted from its exact start: 1124.5 TFLOP/s/GPU where Megatron's formula on the same
    progress.txt gives 948.4 (later jobs agreed)."""
    import time

    from distmetrics.checkpoints import checkpoint_record

    job_start = math.floor(time.time()) - 1 + 0.9  # 0.9 s into a second, about a second ago
    line_start = dt.datetime.fromtimestamp(math.floor(job_start))  # the line's time, as Megatron parses it
    before = dt.datetime.now()
    record = checkpoint_record(10, {}, job_start, 1e6, 1e9, 2)
    after = dt.datetime.now()
    flops = 1e6 * 1e9
    slowest, fastest = (flops / (t - line_start).total_seconds() / 1e12 / 2 for t in (before, after))
    assert fastest <= record["checkpoint/cumulative_tflops_per_gpu"] <= slowest, (record, fastest, slowest)


def test_a_streak_that_saved_nothing_counts_from_a_checkpoint_whose_line_was_lost(tmp_path, caplog):
    """Job A (8 GPUs) saved 10, then 20, whose progress.txt line was lost (its metrics.jsonl record
    was written); job B (1 GPU, a new streak) saved nothing; job C (1 GPU) resumes from 20. The
    checkpoint is counted from the record, and so must the streak's start be: it stayed at line
    10's FLOPs, and C's cumulative throughput counted A's 1e16 FLOPs from 10 to 20 as the streak's."""
    import distmetrics as dm
    from distmetrics.sinks.progress import progress_line

    now = dt.datetime.now().replace(microsecond=0)
    b_start = now - dt.timedelta(hours=1)
    (tmp_path / "progress.txt").write_text("".join([
        progress_line("Starting job", 8, "1", b_start - dt.timedelta(hours=3)),
        progress_line("Saved checkpoint\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: "
                      "1.0 TFLOP/s/GPU\tFloating-point operations: 1.00e+16\tTokens (in billions): 10.00", 8, "1",
                      b_start - dt.timedelta(hours=2)),
        progress_line("Starting job", 1, "1", b_start)]))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"kind": "progress", "step": 20, "checkpoint/tokens": 2e10, "checkpoint/floating_point_operations": 2e16},
        separators=(",", ":")) + "\n")  # as the JSONL sink writes it
    flops_per_token = 1e6
    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False, tensorboard=False,
                                     flops_per_token=flops_per_token, timing_log_level=-1)) as monitor:
        for step in (21, 22):
            monitor.step(step, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(22)
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress" and r["step"] == 22]
    flops = 2e16 + 2000 * flops_per_token
    assert record["checkpoint/floating_point_operations"] == pytest.approx(flops)
    expected = (flops - 2e16) / 3600 / 1e12  # the streak's work: from the 2e16 of the checkpoint C (and B) loaded
    assert record["checkpoint/cumulative_tflops_per_gpu"] == pytest.approx(expected, rel=1e-2)
    assert "no \"Saved checkpoint\" line for iteration 20" in caplog.text


@pytest.mark.parametrize("rollback", [False, True], ids=["from the last checkpoint", "from an older one"])
def test_without_progress_txt_a_restart_counts_checkpoints_on_from_metrics_jsonl(tmp_path, rollback, caplog):
    """log_progress: false: a restart's checkpoints counted tokens and FLOPs from 0 again, without a
    word, though metrics.jsonl held the earlier checkpoints' exact numbers (the README says a
    restart takes them from there)."""
    import distmetrics as dm

    first, last = (11, 20) if rollback else (21, 30)
    base = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=10,
                            flops_per_token=1e9, timing_log_level=-1, log_memory=False, straggler_window=0,
                            log_progress=False)
    for start, end, checkpoints in ((1, 20, (10, 20)), (first, last, (last,))):
        with dm.Monitor(base) as monitor:
            for step in range(start, end + 1):
                monitor.step(step, loss=1.0, tokens=1000)
                if step in checkpoints:
                    monitor.checkpoint_saved(step)
    saved = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"]
    assert [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"]) for r in saved] == [
        (10, 1e4, 1e13), (20, 2e4, 2e13), (last, last * 1000.0, last * 1e12)]
    assert not (tmp_path / "progress.txt").exists()
    assert "progress.txt" not in caplog.text


def test_a_resume_that_finds_no_earlier_checkpoint_says_so_at_its_first(tmp_path, caplog, monkeypatch):
    """log_progress: false, and the checkpoint of job 1 lies before the part of metrics.jsonl searched
    (records of many names after it): job 2 counted tokens and FLOPs from 0 without a word."""
    import distmetrics as dm
    from distmetrics import checkpoints

    monkeypatch.setattr(checkpoints, "_NO_LINE_WITHIN", 1 << 20)
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=1,
                           flops_per_token=1e9, timing_log_level=-1, log_memory=False, straggler_window=0,
                           log_progress=False)
    wide = {f"extra/value_{i}": float(i) for i in range(4000)}  # about 90 KB a record
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 21):
            monitor.step(step, loss=1.0, tokens=1000, **(wide if step > 5 else {}))
            if step == 5:
                monitor.checkpoint_saved(5)
    assert (tmp_path / "metrics.jsonl").stat().st_size > 1 << 20
    with dm.Monitor(cfg) as monitor:
        for step in (21, 22):
            monitor.step(step, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(22)
    last = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"][-1]
    assert last["checkpoint/tokens"] == 2000.0  # this job's alone, and said:
    assert "no checkpoint up to iteration 21 was found in the last 1 MiB of metrics.jsonl" in caplog.text
    assert "no earlier job's files" not in caplog.text
    caplog.clear()  # a job resuming into a fresh folder (its own run record is there by then): told it is one
    with dm.Monitor(cfg.replace(output_dir=str(tmp_path / "fresh"))) as monitor:
        monitor.step(1001, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(1001)
    assert "(this job started at step 1001, a resume, in an output_dir holding no earlier job's files" in caplog.text
    caplog.clear()  # one that saves the checkpoint it loaded first (a loop counting from 0 steps from 1000 next):
    with dm.Monitor(cfg.replace(output_dir=str(tmp_path / "fresher"))) as monitor:  # not told it started at 1001
        monitor.checkpoint_saved(1000)
        monitor.step(1000, loss=1.0, tokens=1000)
        monitor.checkpoint_saved(1001)
    assert "no checkpoint up to iteration 1000 was found in the last 1 MiB of metrics.jsonl (this job saved " \
        "checkpoint 1000, the one it loaded, before its first step, a resume, in an output_dir" in caplog.text


def _resumes_in_a_fresh_folder(rank: int, world: int, root: str) -> dict:
    """A job of steps 11-14 in an empty output_dir, saving checkpoints at 12 and 14 (the earlier
    run's files are elsewhere), and a job of steps 1-2 saving at 2 in another empty one."""
    import logging

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    cfg = quiet_config(log_interval=2, json_log=True, log_progress=True, flops_per_token=1e9)
    out = {}
    for case, steps in (("resumed", range(11, 15)), ("from scratch", range(1, 3))):
        before = len(said)
        with dm.Monitor(cfg.replace(output_dir=f"{root}/{case}")) as monitor:
            for step in steps:
                monitor.step(step, loss=1.0, tokens=1000)
                if step % 2 == 0:
                    monitor.checkpoint_saved(step)
        records = dm.read_jsonl(f"{root}/{case}/metrics.jsonl") if rank == 0 else []
        out[case] = {"said": [m for m in said[before:] if "checkpoint" in m],
                     "tokens": [r["checkpoint/tokens"] for r in records if r["kind"] == "progress"]}
    return out


def test_a_resume_in_a_folder_with_no_earlier_files_says_its_numbers_count_from_this_job(tmp_path):
    """A job whose first step is 11 in an empty output_dir (the earlier run's files elsewhere) counted
    its checkpoints' FLOPs and tokens from this job on without a word, while a folder with earlier
    files but no checkpoint was told. Said once, on the writer rank, at the first checkpoint; a job
    starting at step 1 is not told. Truth: 1,000 tokens a step on each of 2 ranks, this job's alone."""
    out = run_ranks(_resumes_in_a_fresh_folder, 2, str(tmp_path), timeout=120)
    said = out[0]["resumed"]["said"]
    assert len(said) == 1 and "no checkpoint up to iteration 11 was found in progress.txt or the last 64 MiB of " \
        "metrics.jsonl (this job started at step 11, a resume, in an output_dir holding no earlier job's files" in \
        said[0] and "count from this job on" in said[0], said
    assert out[0]["resumed"]["tokens"] == [2 * 2 * 1000.0, 4 * 2 * 1000.0]
    assert out[1]["resumed"]["said"] == [] and out[0]["from scratch"]["said"] == out[1]["from scratch"]["said"] == []


def _checkpoint_numbers(rank: int, world: int, root: str, part: str) -> dict:
    """``rollback``, per numbering (steps from 1, checkpoint s after step s; steps from 0, checkpoint
    s + 1 after step s): job 1 saves a checkpoint after every step up to checkpoint 23 (as a run saving
    every step, killed at 24, leaves it); job 2 rolls back to checkpoint 20 and saves 21 and 22.
    ``labels``: a job asking for checkpoints numbered neither the last step nor the next, then 10 and
    11 after step 10. Rank r gives 3 + r tokens a step."""
    from pathlib import Path

    import distmetrics as dm

    cfg = quiet_config(log_interval=5, json_log=True, log_progress=True, flops_per_token=1000.0)
    tokens = 3 + rank
    out: dict = {}
    for numbering, shift in (("from 1", 0), ("from 0", 1)) if part == "rollback" else ():
        folder = f"{root}/{numbering}"
        for loaded, last in ((0, 23), (20, 22)):
            with dm.Monitor(cfg.replace(output_dir=folder)) as monitor:
                for done in range(loaded + 1, last + 1):  # the steps the checkpoint saved after this one holds
                    monitor.step(done - shift, loss=1.0, tokens=tokens)
                    monitor.checkpoint_saved(done)
        if rank == 0:
            out[numbering] = [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"])
                              for r in dm.read_jsonl(f"{folder}/metrics.jsonl") if r["kind"] == "progress"]
    if part == "rollback":
        return out
    import logging

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    with dm.Monitor(cfg.replace(output_dir=f"{root}/labels")) as monitor:
        for step in range(1, 11):
            monitor.step(step, loss=1.0, tokens=tokens)
            for label in (100,) if step == 4 else (4, 12) if step == 10 else ():
                monitor.checkpoint_saved(label)  # written all the same: the save is on disk
        monitor.checkpoint_saved(10)
        monitor.checkpoint_saved(11)
    logging.getLogger("distmetrics").removeHandler(handler)
    refused = [m for m in said if "checkpoint_saved" in m]
    out["refused"] = refused
    if rank == 0:
        out["lines"] = [line.split("\t")[4] for line in Path(root, "labels", "progress.txt").read_text().splitlines()
                        if "Saved checkpoint" in line]
        out["labels"] = [(r["step"], r["checkpoint/tokens"]) for r in dm.read_jsonl(f"{root}/labels/metrics.jsonl")
                         if r["kind"] == "progress"]
    return out


def test_a_rollback_past_checkpoints_at_consecutive_steps_counts_on_from_the_one_it_loaded(tmp_path):
    """Steps numbered from 1 with a checkpoint every step: a job rolled back to checkpoint 20 (first
    step 21) counted on from the earlier job's checkpoint 21, so its checkpoints' tokens and FLOPs
    were a step high (154 tokens at 21, for the 147 of 21 steps). The record of each save holds the
    last step before it (``after_step``): checkpoint 21 of the earlier job holds step 21, after this
    job's start. A loop counting from 0 (first step 20 after checkpoint 20) is unchanged. Truth: a
    checkpoint holding n steps holds n x 7 tokens (3 + 4 a step on the two ranks), x 1000 FLOPs."""
    out = run_ranks(_checkpoint_numbers, 2, str(tmp_path), "rollback", timeout=300)
    per_step = sum(3 + rank for rank in range(2))
    truth = [(n, n * per_step * 1.0, n * per_step * 1000.0) for n in (*range(1, 24), 21, 22)]
    for numbering in ("from 1", "from 0"):
        assert out[0][numbering] == truth, (numbering, out[0][numbering][-3:])


def test_checkpoint_saved_says_once_a_number_other_than_the_last_step_or_the_next(tmp_path):
    """checkpoint_saved(4) after step 10 wrote "Iteration: 4" with the tokens of 10 steps (a restart
    from 4 counted on from them), checkpoint_saved(100) at step 4 was taken silently. Said once, on one
    rank, naming the step and the last step; every checkpoint is written all the same (the save is on
    disk, and a long job is not stopped over a label). Truth: 7 tokens a step over the two ranks."""
    out = run_ranks(_checkpoint_numbers, 2, str(tmp_path), "labels", timeout=120)
    assert out[1]["refused"] == [] and len(out[0]["refused"]) == 1, out
    said = out[0]["refused"][0]
    assert said.startswith("distmetrics: monitor.checkpoint_saved(100) came after monitor.step(4): its "
                           "progress.txt line and record hold the tokens and FLOPs of the steps up to step 4"), said
    assert "report an asynchronous save when it starts. Said once" in said
    assert out[0]["lines"] == ["Iteration: 100", "Iteration: 4", "Iteration: 12", "Iteration: 10", "Iteration: 11"]
    assert out[0]["labels"] == [(100, 28.0), (4, 70.0), (12, 70.0), (10, 70.0), (11, 70.0)]


def test_a_checkpoint_reported_late_keeps_its_number_at_a_restart(tmp_path, caplog):
    """A loop counting from 0 reports checkpoint 10 after step 12 (an asynchronous save reported when it
    ended): said once, and its record holds the 13 steps' tokens. A job resuming from it (first step 10)
    counted on from checkpoint 5 instead (1000 tokens at checkpoint 15, and a warning that no checkpoint
    followed 5): a save reported late is not one saved after its own number. It counts on from 10's
    record, as the warning said: 1300 + 5 steps x 100."""
    import distmetrics as dm

    cfg = quiet_config(log_interval=1, json_log=True, log_progress=True, output_dir=str(tmp_path))
    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(cfg) as monitor:
        for step in range(13):
            monitor.step(step, loss=1.0, tokens=100)
            if step == 4:
                monitor.checkpoint_saved(5)
        monitor.checkpoint_saved(10)
    with dm.Monitor(cfg) as monitor:
        for step in range(10, 15):
            monitor.step(step, loss=1.0, tokens=100)
        monitor.checkpoint_saved(15)
    saved = [(r["step"], r["checkpoint/tokens"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")
             if r["kind"] == "progress"]
    assert saved == [(5, 500.0), (10, 1300.0), (15, 1800.0)], saved
    said = [r.getMessage() for r in caplog.records]
    assert sum("checkpoint_saved(10) came after monitor.step(12)" in m for m in said) == 1, said
    assert not any("no checkpoint after iteration" in m for m in said), said


def test_ranks_of_one_host_on_one_gpu_are_named_at_start_up(caplog):
    """Without torch.cuda.set_device(local_rank) every rank of a host opens cuda:0: each read that GPU's
    energy counter as its own and the job's energy total counted it once per rank, without a word.
    The start-up gather holds every rank's GPU UUID (a GPU cannot exist here: the rows are made by
    hand, as the gather would return them)."""
    from distmetrics.parallel import RankInfo
    from distmetrics.runinfo import _say_shared_gpus

    caplog.set_level(logging.WARNING, logger="distmetrics")
    rows = {"node-a": [RankInfo(r, "node-a", r, 100 + r, {"uuid": "GPU-0000" if r < 2 else f"GPU-{r}"})
                       for r in range(3)],
            "node-b": [RankInfo(r, "node-b", r - 3, 100 + r, {"uuid": f"GPU-{r}"}) for r in range(3, 5)]}
    _say_shared_gpus(rows)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "ranks 0, 1 on node-a all use GPU GPU-0000" in said[0], said
    assert "torch.cuda.set_device(local_rank)" in said[0]
    caplog.clear()
    _say_shared_gpus({"node-b": rows["node-b"], "node-c": [RankInfo(5, "node-c", 0, 1, None)]})
    assert caplog.records == []


@pytest.mark.parametrize("first", [1, 6], ids=["from scratch", "rolled back past the streak's start"])
def test_a_job_behind_its_streaks_start_starts_a_streak_of_its_own(tmp_path, first):
    """Job A (8 GPUs) saved 5 and 10; job B (1 GPU, a new streak) resumed from A's 10 and saved 20;
    job C (1 GPU) starts from scratch, or from A's 5, older than B's start. C's FLOPs counted on
    from what it loaded, its streak's from B's 1e16: its cumulative throughput was negative
    (-17819.3 TFLOP/s/GPU in a run)."""
    from distmetrics.sinks.progress import progress_line

    now = dt.datetime.now().replace(microsecond=0)

    (tmp_path / "progress.txt").write_text("".join([
        progress_line("Starting job", 8, "1", now - dt.timedelta(hours=4)),
        _saved_line(5, 0.5e16, 5.0, 8, now - dt.timedelta(hours=3, minutes=30)),
        _saved_line(10, 1e16, 10.0, 8, now - dt.timedelta(hours=3)),
        progress_line("Starting job", 1, "1", now - dt.timedelta(hours=2)),
        _saved_line(20, 2e16, 20.0, 1, now - dt.timedelta(hours=1))]))
    flops_per_token = 1e6
    record = _two_steps_and_a_checkpoint(tmp_path, first, flops_per_token)
    origin = 0.0 if first == 1 else 0.5e16  # the checkpoint C loaded: none, or A's 5 (older than B's start)
    assert record["checkpoint/floating_point_operations"] == pytest.approx(origin + 2000 * flops_per_token)
    # C's own streak: its FLOPs over the time since its start, to the second as Megatron reads it (so at most
    # the job's throughput, which counts from its exact start: much less in a job of a fraction of a second)
    assert 0 < record["checkpoint/cumulative_tflops_per_gpu"] <= record["checkpoint/job_tflops_per_gpu"]


@pytest.mark.parametrize("first_call", ["log_eval", "checkpoint_saved", None])
@pytest.mark.parametrize("origin", [0, 1], ids=["steps from 0", "steps from 1"])
def test_a_rollback_past_consecutive_checkpoints_counts_on_from_the_one_loaded(tmp_path, origin, first_call):
    """Job A saved a checkpoint at every step; job B rolls back to checkpoint 10 and evaluates it (or saves it
    again) before its first step. Where steps count from 0 (checkpoint s + 1 saved after step s) its checkpoints
    counted on from checkpoint 11, one step's tokens and FLOPs too many (1200 at checkpoint 11); the evaluation
    or save was taken for the step before a first step at 11."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, flops_per_token=1.0, console=False,
                           tensorboard=False, timing_log_level=-1)
    for first, last, call in ((origin, 11 + origin, None), (10 + origin, 12 + origin, first_call)):
        with dm.Monitor(cfg) as monitor:
            if call == "log_eval":
                monitor.log_eval(10, loss=1.0, tokens=1)
            elif call == "checkpoint_saved":
                monitor.checkpoint_saved(10)
            for step in range(first, last + 1):
                monitor.step(step, loss=1.0, tokens=100)
                monitor.checkpoint_saved(step + 1 - origin)  # the steps done
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    job_b = records[[i for i, r in enumerate(records) if r["kind"] == "run"][1]:]
    saved = [(r["step"], r["checkpoint/tokens"], r["checkpoint/floating_point_operations"]) for r in job_b
             if r["kind"] == "progress"]
    assert saved == [(c, 100.0 * c, 100.0 * c) for c in ([10] if first_call == "checkpoint_saved" else []) +
                     [11, 12, 13]], saved


def _job_saving_checkpoints(rank: int, world: int, root: str, steps: list, saves: list) -> dict:
    """One job of ``steps`` (1,000 tokens a step on each rank) in ``root``, saving a checkpoint after
    each step in ``saves``: on the writer rank, the wall-clock times just before and after each save."""
    import time

    import distmetrics as dm

    cfg = quiet_config(output_dir=root, log_interval=2, json_log=True, log_progress=True, flops_per_token=1e9)
    around = {}
    with dm.Monitor(cfg) as monitor:
        for step in steps:
            monitor.step(step, loss=1.0, tokens=1000)
            if step in saves:
                before = time.time()
                monitor.checkpoint_saved(step)
                around[step] = (before, time.time())
    return around


def test_a_job_after_one_that_began_a_streak_of_its_own_counts_on_in_that_streak(tmp_path):
    """Job A (1 rank) saves 2 and 4; job B (2 ranks, a new streak) resumes from 4 and saves 6; job C
    (2 ranks) rolls back to A's 2, older than B's start, so it began a streak of its own; job D
    (2 ranks) resumes from C's 4 and saves 6. D counted its cumulative throughput in B's streak:
    FLOPs from B's start (A's 4) over the time since B started, a lineage D's checkpoint never
    passed through. Truth by hand: 1e12 FLOPs a step on each rank; D's 6 holds A's two steps (2e12)
    and C's and D's four steps on 2 ranks (8e12); C's streak counts from the 2e12 it loaded, over the
    time since C's "Starting job" line, bracketed by D's clock around its save."""
    import distmetrics as dm

    root = str(tmp_path)
    for world, steps, saves in ((1, [1, 2, 3, 4], [2, 4]), (2, [5, 6], [6]), (2, [3, 4], [4])):
        run_ranks(_job_saving_checkpoints, world, root, steps, saves, timeout=120)
    before, after = run_ranks(_job_saving_checkpoints, 2, root, [5, 6], [6], timeout=120)[0][6]
    starts = [line.split("\t")[0] for line in (tmp_path / "progress.txt").read_text().splitlines()
              if line.endswith("\tStarting job")]
    assert len(starts) == 4
    c_start = dt.datetime.strptime(starts[2], "%Y-%m-%d %H:%M:%S").timestamp()
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "progress"][-1]
    assert record["step"] == 6 and record["checkpoint/floating_point_operations"] == pytest.approx(1e13)
    work = (1e13 - 2e12) / 1e12 / 2  # TFLOPs per GPU since the checkpoint C loaded
    low, high = work / (after - c_start), work / (before - c_start)
    assert low * (1 - 1e-9) <= record["checkpoint/cumulative_tflops_per_gpu"] <= high * (1 + 1e-9), \
        (record["checkpoint/cumulative_tflops_per_gpu"], low, high)
