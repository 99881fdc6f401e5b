"""What only an NVIDIA GPU shows: CUDA-event timers, NVML energy, power, telemetry and identity,
packs built on the device, norms of CUDA gradients, NCCL.

Skipped where torch sees no CUDA device (this project's CI machine) and in a run of the whole
suite, which hides the GPU (tests/conftest.py); on a GPU machine run
``python -m pytest tests/test_cuda.py`` (``launch/test.sh`` does, after the suite). Nothing is mocked. The references are independent of
the code under test: ``nvidia-smi`` and NVML read directly, megatron-core's own ``Timers`` timing
the same GPU work, a wall clock around a ``torch.cuda.synchronize``, float64 on the host.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

from tests.dist_utils import free_port, quiet_config, run_child

if torch.version.cuda is None:
    _WHY = "needs a CUDA device (this torch is a CPU build)"
elif os.environ.get("CUDA_VISIBLE_DEVICES") == "":
    _WHY = "the whole suite hides the GPU (tests/conftest.py): run python -m pytest tests/test_cuda.py"
else:
    _WHY = "needs a CUDA device"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=_WHY)


def _smi(*fields: str) -> list[str]:
    """This process's GPU as nvidia-smi reports it (CUDA_VISIBLE_DEVICES is not set in these runs)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                          f"--id={torch.cuda.current_device()}"], capture_output=True, text=True, check=True)
    return [v.strip() for v in out.stdout.strip().split(",")]


def _cycles_per_ms() -> float:
    """GPU clock cycles in a millisecond of ``torch.cuda._sleep`` (a spin kernel), by wall clock."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()
    return 50_000_000 / ((time.perf_counter() - t) * 1000)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cuda_timer_times_the_gpu_work_without_waiting_for_it():
    from distmetrics.collectors.timers import Timers

    cycles = _cycles_per_ms()
    timers = Timers(log_level=2, log_option="minmax")
    assert timers._use_cuda  # on a GPU machine the default is CUDA events
    torch.cuda.synchronize()
    host_in_calls = 0.0
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in start/stop raises
    try:
        for _ in range(5):
            t = time.perf_counter()
            timers("work", log_level=0).start()
            host_in_calls += time.perf_counter() - t
            torch.cuda._sleep(int(20 * cycles))
            t = time.perf_counter()
            timers("work").stop()
            host_in_calls += time.perf_counter() - t
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ours = timers("work").elapsed(reset=True)
    assert host_in_calls < 0.05 * wall, (host_in_calls, wall)  # start/stop never waited for the ~100 ms
    assert ours == pytest.approx(wall, rel=0.05), (ours, wall)


def test_cuda_timer_agrees_with_megatron_cores_timers_on_the_same_work():
    from megatron.core.timers import Timers as MegatronTimers

    from distmetrics.collectors.timers import Timers

    cycles = _cycles_per_ms()
    theirs, ours = MegatronTimers(log_level=2, log_option="minmax"), Timers(log_level=2, log_option="minmax")
    totals = {}
    for name, timers in (("megatron", theirs), ("ours", ours)):
        torch.cuda.synchronize()
        for ms in (5, 10, 20, 40):
            timers("work", log_level=0).start()
            torch.cuda._sleep(int(ms * cycles))
            timers("work").stop()
        totals[name] = timers("work").elapsed(reset=True)
    assert totals["ours"] == pytest.approx(totals["megatron"], rel=0.03), totals
    assert totals["ours"] == pytest.approx(0.075, rel=0.10), totals


@pytest.mark.parametrize("form", ["with", "start/stop"])
def test_a_cuda_timer_inside_compiled_code_times_every_call_and_compiles_each_graph_once(form):
    """Dynamo traces CUDA events: a timer's start/stop traced into the graph would replay the events
    made while tracing, and its state be guarded on (a recompile per call). Each is a graph break,
    run eagerly: 6 calls of 10 ms of GPU work time 60 ms, and no graph is compiled twice."""
    from distmetrics.collectors.timers import Timers
    from tests.test_compile import _counting_backend

    cycles = _cycles_per_ms()
    torch._dynamo.reset()
    timers = Timers(log_level=2, log_option="minmax")
    backend, graphs = _counting_backend()

    @torch.compile(backend=backend)
    def block(x):
        y = x.sin()
        if form == "with":
            with timers("work", log_level=1):
                torch.cuda._sleep(int(10 * cycles))
                y = y * 2
        else:
            timers("work", log_level=1).start()
            torch.cuda._sleep(int(10 * cycles))
            y = y * 2
            timers("work").stop()
        return y.cos()

    x = torch.randn(8, device="cuda")
    for _ in range(6):
        block(x)
    torch.cuda.synchronize()
    assert len(graphs) <= 3, graphs  # before the timer, inside it, after it: none compiled twice
    assert timers("work").elapsed(reset=True) == pytest.approx(0.060, rel=0.10)


def test_timers_at_a_log_step_on_cuda_match_a_synchronised_clock(tmp_path):
    import distmetrics as dm

    cycles = _cycles_per_ms()
    monitor = dm.Monitor(quiet_config(log_interval=2, timing_log_level=1, output_dir=str(tmp_path)))
    walls = []
    for step in (1, 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with monitor.timers("fwd", log_level=1):
            torch.cuda._sleep(int(30 * cycles))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        m = monitor.step(step)
    monitor.close()
    # per step, over the interval's two steps: each step's ~30 ms of GPU work
    assert m["timers/fwd"] == pytest.approx(sum(walls) / 2 * 1000, rel=0.05), (m["timers/fwd"], walls)


def test_the_step_timer_makes_no_cuda_event_between_log_steps_and_times_the_steps(monkeypatch):
    import distmetrics as dm

    made = []

    class CountedEvent(torch.cuda.Event):  # the real event, counted where the timers make one
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__()

    cycles = _cycles_per_ms()
    monitor = dm.Monitor(quiet_config(log_interval=10, timing_log_level=0))
    monkeypatch.setattr(torch.cuda, "Event", CountedEvent)
    monitor.step(1)  # the step timer starts: one event
    torch.cuda.synchronize()
    t = time.perf_counter()
    for step in range(2, 11):
        torch.cuda._sleep(int(10 * cycles))
        torch.cuda.synchronize()
        if step < 10:
            monitor.step(step)
            assert len(made) == 1, (step, len(made))  # a non-log step records nothing
    wall = time.perf_counter() - t
    m = monitor.step(10)
    monitor.close()
    assert len(made) <= 3, len(made)
    assert m["timers/step"] == pytest.approx(wall / 9 * 1000, rel=0.05), (m["timers/step"], wall / 9 * 1000)


def test_energy_power_and_telemetry_match_nvml_and_nvidia_smi(tmp_path):
    import pynvml

    import distmetrics as dm

    uuid, max_sm = _smi("uuid", "clocks.max.sm")
    max_sm = float(max_sm)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())

    def energy_j():
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0

    cfg = quiet_config(log_interval=2, log_energy=True, log_gpu_telemetry=True, log_throughput=True,
                       json_log=True, output_dir=str(tmp_path))
    monitor = dm.Monitor(cfg)
    a = torch.randn(8192, 8192, device="cuda")
    before_first = energy_j()
    monitor.step(1, tokens=1000)  # the energy count starts here
    after_first, t_after_first = energy_j(), time.perf_counter()
    deadline = time.perf_counter() + 2.0
    while time.perf_counter() < deadline:  # about 2 s of matrix products: the GPU draws real power
        for _ in range(20):
            a = torch.tanh(a @ a / 8192 ** 0.5)
        torch.cuda.synchronize()
    before_log, t_before_log = energy_j(), time.perf_counter()
    m = monitor.step(2, tokens=1000)
    after_log = energy_j()
    temperature = float(_smi("temperature.gpu")[0])
    monitor.close()
    inner, outer = before_log - after_first, after_log - before_first
    assert inner > 100.0, inner  # two seconds of an H100-class GPU at work is hundreds of joules
    assert inner - 2.0 <= m["energy/total_j"] <= outer + 2.0, (inner, m["energy/total_j"], outer)
    assert m["energy/job_total_j"] == pytest.approx(m["energy/total_j"])
    assert m["energy/j_per_gpu_per_step"] == pytest.approx(m["energy/total_j"])  # one timed step, one GPU
    assert m["energy/j_per_token"] == pytest.approx(m["energy/total_j"] / 1000)
    watts = inner / (t_before_log - t_after_first)
    assert m["power/max_w"] == pytest.approx(watts, rel=0.05), (m["power/max_w"], watts)
    assert m["power/mean_w"] == pytest.approx(watts, rel=0.05), (m["power/mean_w"], watts)
    assert m["gpu/max_sm_clock_mhz/max"] == max_sm
    assert 0 < m["gpu/sm_clock_mhz/max"] <= max_sm
    assert m["gpu/temperature_c/max"] == pytest.approx(temperature, abs=5)
    assert m["gpu/slowdown_temperature_c/max"] > m["gpu/temperature_c/max"]
    # the record on disk holds the same values
    train = [r for r in _records(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert train["energy/total_j"] == m["energy/total_j"] and train["power/max_w"] == m["power/max_w"]


def test_gpu_model_record_names_this_gpu_as_nvidia_smi_does(tmp_path):
    import distmetrics as dm

    name, uuid, driver, memory_mib = _smi("name", "uuid", "driver_version", "memory.total")
    monitor = dm.Monitor(quiet_config(json_log=True, output_dir=str(tmp_path)))
    monitor.close()
    (record,) = [r for r in _records(tmp_path / "metrics.jsonl") if r["kind"] == "gpu_model"]
    (gpu,) = record["ranks"]
    assert gpu["uuid"] == uuid  # the UUID NVML opens must be this GPU's, as nvidia-smi spells it
    assert gpu["name"] == name and gpu["driver"] == driver
    assert gpu["memory_gib"] == pytest.approx(float(memory_mib) / 1024, rel=0.03)
    from distmetrics.flops import peak_tflops_for

    if "H100" in name or "H200" in name:
        assert peak_tflops_for(name, "bf16") in (989.0, 756.0)


def test_memory_metrics_match_torchs_allocator_statistics():
    import distmetrics as dm

    gib = 1024 ** 3
    monitor = dm.Monitor(quiet_config(log_interval=1, log_memory=True))
    peak = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")  # 512 MiB, then let go
    del peak
    kept = torch.empty(64 * 2 ** 20, dtype=torch.uint8, device="cuda")
    before = torch.cuda.memory_stats()  # torch's own flattened reading, the reference
    m = monitor.step(1)
    after = torch.cuda.memory_stats()
    monitor.close()
    for name, key in (("allocated_gib", "allocated_bytes.all.current"), ("max_allocated_gib", "allocated_bytes.all.peak"),
                      ("reserved_gib", "reserved_bytes.all.current"), ("max_reserved_gib", "reserved_bytes.all.peak")):
        assert before[key] / gib - 1e-6 <= m[f"memory/{name}"] <= after[key] / gib + 1e-6, (name, before[key], after[key])
    assert m["memory/max_allocated_gib"] >= 0.5 and m["memory/allocated_gib"] >= 1 / 16
    assert m["memory/alloc_retries"] == before["num_alloc_retries"] and m["memory/ooms"] == before["num_ooms"]
    assert m["memory/host_rss_gib"] > 0
    del kept


def _model(modules: int, width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(modules)]).cuda()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) * (1 + i % 7)
    return model


def test_norms_of_cuda_gradients_match_float64_and_torch_clip():
    import distmetrics as dm

    model = _model(20)
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    truth = sum(float((g * g).sum()) for g in grads.values()) ** 0.5
    reference = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        probe = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p, g in zip(probe, reference):
        p.grad = g
    torch_norm = float(torch.nn.utils.clip_grad_norm_(probe, 1.0))
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    norm = monitor.clip_grad_norm_(1.0)
    m = monitor.step(1)
    monitor.close()
    assert float(norm) == pytest.approx(truth, rel=1e-6) and torch_norm == pytest.approx(truth, rel=1e-6)
    assert m["grad_norm"] == pytest.approx(truth, rel=1e-6)
    for i in range(20):
        module = sum(float((grads[f"{i}.{k}"] ** 2).sum()) for k in ("weight", "bias")) ** 0.5
        assert m[f"grad_norm/{i}"] == pytest.approx(module, rel=1e-5)
    for p, q in zip(model.parameters(), probe):  # clipped as torch clips
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def _log_step_syncs(modules: int) -> tuple[int, int]:
    """(synchronising CUDA calls, device-to-host copies) of a clip + log step at log_interval 1."""
    import distmetrics as dm

    model = _model(modules)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_memory=True), model=model)
    for step in (1, 2):  # warm: the schema is negotiated on the first log step
        monitor.clip_grad_norm_(1.0)
        monitor.step(step, loss=torch.tensor(2.0, device="cuda"), tokens=torch.tensor(10, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            warnings.simplefilter("always")
            monitor.clip_grad_norm_(1.0)
            monitor.step(3, loss=torch.tensor(2.0, device="cuda"), tokens=torch.tensor(10, device="cuda"))
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.close()
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    copies = sum(1 for e in prof.events() if "Memcpy DtoH" in e.name)
    return syncs, copies


def test_a_log_step_copies_to_the_host_once_per_pack_not_once_per_name():
    small, large = _log_step_syncs(10), _log_step_syncs(200)
    assert small == large, (small, large)  # 10 or 200 modules: the same copies
    assert large[1] <= 3, large  # the packs, not a copy per name


def _nccl_child(port: str) -> None:
    import torch.distributed as dist

    import distmetrics as dm

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    model = _model(8)
    grads = [p.grad.detach().double().cpu() for p in model.parameters()]
    monitor = dm.Monitor(quiet_config(log_interval=2, log_memory=True), model=model)
    losses, tokens = [2.5, 1.5], [30, 10]
    for step in (1, 2):
        monitor.measure_grad_norms()
        m = monitor.step(step, loss=torch.tensor(losses[step - 1], device="cuda"),
                         tokens=torch.tensor(tokens[step - 1], device="cuda"))
    monitor.close()
    truth = sum(float((g * g).sum()) for g in grads) ** 0.5
    assert m["grad_norm"] == pytest.approx(truth, rel=1e-6), (m["grad_norm"], truth)
    assert m["train/loss"] == pytest.approx((2.5 * 30 + 1.5 * 10) / 40), m["train/loss"]
    assert m["memory/max_allocated_gib"] == pytest.approx(torch.cuda.max_memory_allocated() / 1024 ** 3, rel=0.05)
    dist.destroy_process_group()
    print("nccl ok")


def test_nccl_world_of_one_builds_and_reduces_packs_on_the_gpu():
    done = run_child("tests.test_cuda._nccl_child", str(free_port()), timeout=300)
    assert done.returncode == 0 and "nccl ok" in done.stdout, done.stdout + done.stderr


def test_the_recording_api_on_cuda_tensors_waits_for_no_device_between_log_steps_and_matches_float64():
    """``record`` with a tensor value and weight, ``record_losses`` with integer ids on the GPU (sparse:
    an id of 10**12, and -100 as an ignore index), ``record_moe`` with counts on the GPU: no call
    synchronises the device (``set_sync_debug_mode("error")``), and the log step's values are float64's."""
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2))
    names = {10 ** 12: "web", 5: "code"}
    gen = torch.Generator().manual_seed(0)
    truth: dict = {"v": [0.0, 0.0], "web": [0.0, 0.0], "code": [0.0, 0.0],
                   "counts": torch.zeros(2, 4, dtype=torch.float64)}
    for step in (1, 2):
        losses = torch.rand(64, generator=gen, dtype=torch.float64)
        ids = torch.tensor([10 ** 12, 5, -100, 7])[torch.randint(0, 4, (64,), generator=gen)]
        counts = torch.randint(1, 50, (2, 4), generator=gen)
        value, weight = float(losses[0]), float(step * 3)
        truth["v"][0] += value * weight
        truth["v"][1] += weight
        for i, name in names.items():
            truth[name][0] += float(losses[ids == i].sum())
            truth[name][1] += int((ids == i).sum())
        truth["counts"] += counts
        on_gpu = [t.cuda() for t in (torch.tensor(value), torch.tensor(weight), losses.float(), ids, counts)]
        torch.cuda.synchronize()  # the copies to the GPU are the test's: the calls below must make none
        torch.cuda.set_sync_debug_mode("error")
        try:
            monitor.record("train/v", on_gpu[0], weight=on_gpu[1])
            monitor.record_losses(on_gpu[2], on_gpu[3], names=names)
            monitor.record_moe(tokens_per_expert=on_gpu[4], layer_numbers=[1, 2])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        m = monitor.step(step)
    monitor.close()
    assert m["train/v"] == pytest.approx(truth["v"][0] / truth["v"][1], rel=1e-6)
    for name in names.values():
        assert m[f"train/loss/{name}"] == pytest.approx(truth[name][0] / truth[name][1], rel=1e-6), name
    per_layer = truth["counts"].max(dim=1).values / truth["counts"].mean(dim=1)
    assert m["moe/load_imbalance"] == pytest.approx(float(per_layer.max()), rel=1e-6)
    assert m["moe/expert_utilization"] == 1.0


def test_tensor_statistics_of_cuda_tensors_wait_for_no_device_in_forward_and_backward_and_match_float64(tmp_path):
    """nvdlfw-inspect's LogTensorStats (our namespace) on a CUDA model: the hooked forward and backward of
    a statistics step make no synchronising call (``set_sync_debug_mode("error")``), and the record's
    activation and gradient statistics are float64's of the same tensors, recomputed on the host."""
    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(64, 96), "fc2": torch.nn.Linear(96, 8)}).cuda()
    stats = ["max", "min", "mean", "l1_norm", "l2_norm"]
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient"],
                                                          "stats": stats, "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    truth = {}
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                model.fc2(torch.tanh(model.fc1(x))).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            w1, b1, w2 = (t.detach().double().cpu() for t in (model.fc1.weight, model.fc1.bias, model.fc2.weight))
            activation = torch.nn.functional.linear(x.double().cpu(), w1, b1).requires_grad_()
            (torch.tanh(activation) @ w2.T).sum().backward()
            truth[step] = {"activation": activation.detach().reshape(-1), "gradient": activation.grad.reshape(-1)}
            model.zero_grad()
            monitor.step(step)
    records = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    for step, tensors in truth.items():
        for tensor, t in tensors.items():
            for stat, value in (("max", t.max()), ("min", t.min()), ("mean", t.mean()), ("l1_norm", t.abs().sum()),
                                ("l2_norm", t.norm())):
                logged = records[step][f"tensor_stats/fc1/{tensor}/{stat}"]
                assert logged == pytest.approx(float(value), rel=1e-5, abs=1e-7), (step, tensor, stat)


def _megatron_child(port: str, clip: str) -> None:
    """Megatron-Core's GPTModel under its DistributedDataParallel and DistributedOptimizer on one
    GPU (NCCL, a world of one), Megatron clipping at ``clip``: per step our gradient, parameter and
    update norms, Megatron's reported norm and float64 truth from the tensors. Also runs on the CPU
    (gloo, ``cuda_on_cpu``) where there is no GPU, which is how this child is checked off a GPU."""
    import json as _json

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt, cuda_on_cpu, wrap_with_optimizer
    from tests.dist_utils import subtree_norms

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            **({"device_id": torch.device("cuda", 0)} if cuda else {}))
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    apply_cpu_adaptations(seed=1234)
    ddp, optimizer = wrap_with_optimizer(build_gpt(num_layers=2, hidden=64, heads=4, vocab=128, seq=16), lr=1e-2,
                                         clip_grad=float(clip), distributed=True)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True), model=ddp,
                         optimizer=optimizer)
    params = dict(ddp.module.named_parameters())
    device = next(iter(params.values())).device
    out = []
    for step in (1, 2):
        rows = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(step)).to(device)
        positions = torch.arange(16, device=device).unsqueeze(0).expand(4, 16)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool, device=device), 1).view(1, 1, 16, 16)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(rows[:, :-1].contiguous(), positions, mask, labels=rows[:, 1:].contiguous()).mean().backward()
        ddp.finish_grad_sync()
        grads = {n: float(p.main_grad.detach().double().pow(2).sum()) for n, p in params.items()}
        before = {n: p.detach().double().clone() for n, p in params.items()}
        ours = float(monitor.measure_grad_norms())
        with cuda_on_cpu():
            _, megatron_norm, _ = optimizer.step()
        m = monitor.step(step)
        after = {n: p.detach().double() for n, p in params.items()}
        out.append({"ours": ours, "megatron": float(megatron_norm), "grad": subtree_norms(grads),
                    "param": subtree_norms({n: float(t.pow(2).sum()) for n, t in after.items()}),
                    "update": subtree_norms({n: float((after[n] - before[n]).pow(2).sum()) for n in params}),
                    "metrics": {k: v for k, v in m.items() if isinstance(v, float)}, "device": str(device)})
    monitor.close()
    dist.destroy_process_group()
    print("megatron " + _json.dumps(out))


@pytest.mark.parametrize("clip", ["0.05", "0.0"])
def test_megatron_distributed_optimizer_on_the_gpu_norms_match_megatron_and_float64(clip):
    done = run_child("tests.test_cuda._megatron_child", str(free_port()), clip, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = json.loads(done.stdout.split("megatron ", 1)[1].splitlines()[0])
    for step in steps:
        m = step["metrics"]
        assert step["device"].startswith("cuda"), step["device"]
        assert step["ours"] == pytest.approx(step["grad"]["total"], rel=1e-5)
        assert step["megatron"] == pytest.approx(step["grad"]["total"], rel=1e-5)  # Megatron's own norm, on the GPU
        for family in ("grad", "param", "update"):
            truth = step[family]
            assert m[f"{family}_norm"] == pytest.approx(truth["total"], rel=1e-5), family
            for module, value in truth["modules"].items():
                assert m[f"{family}_norm/{module}"] == pytest.approx(value, rel=1e-4, abs=1e-9), (family, module)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
