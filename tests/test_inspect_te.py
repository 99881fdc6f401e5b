"""The TransformerEngine path of tensor inspection, run on CPU.

TransformerEngine needs a GPU and cannot be installed here. Its layers and its debug features
are replaced — at the narrowest boundary, the nvdlfw-inspect namespace and the layer that calls
it — by ``tests/te_cpu.py`` (a linear layer with FP8 E4M3 current scaling emulated by torch's
``float8_e4m3fn``) and ``tests/te_cpu_features`` (the ``transformer_engine`` namespace with TE's
API, step selection, reduction rules and ``<layer>_<tensor>_<stat>`` logging). Everything of
distmetrics runs for real: the shipped ``configs/fp8_tensor_stats.yaml``, ``dm.inspect.initialize``
before the model is built, layer naming, the forwarding of logged values, the all-gather that
brings every stage's values to the writer, and the sinks (JSONL, TensorBoard read back).

Ground truth: float64 statistics of the full tensors (both ranks, both micro-batches) captured by
the test's own hooks, quantized again by the test's own E4M3 cast.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.dist_utils import run_ranks

SHIPPED = str(Path(__file__).resolve().parents[1] / "configs" / "fp8_tensor_stats.yaml")
STEPS = 12      # the shipped file's freq is 10: iterations 0 and 10 (monitor steps 1 and 11)
MICRO = 2
STATS_STEPS = (1, 11)


def _model():
    import torch
    from torch import nn

    from tests.te_cpu import Fp8Linear

    torch.manual_seed(0)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = Fp8Linear(8, 16)
            self.linear_fc2 = Fp8Linear(16, 8)

        def forward(self, x):
            return self.linear_fc2(torch.relu(self.linear_fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp()
            self.head = nn.Linear(8, 1)  # not selected by the YAML

        def forward(self, x):
            return self.head(self.mlp(x))

    return Net()


def _capture(model, seen: dict, step_box: list) -> None:
    """The test's own record of every tensor the layers saw on the stats steps."""
    for short, module in (("fc1", model.mlp.linear_fc1), ("fc2", model.mlp.linear_fc2)):
        def hook(mod, inputs, output, short=short):
            step = step_box[0]
            if step not in STATS_STEPS:
                return
            seen.setdefault((short, "activation", step), []).append(inputs[0].detach().reshape(-1).tolist())
            seen.setdefault((short, "weight", step), []).append(mod.weight.detach().reshape(-1).tolist())
            output.register_hook(lambda g: seen.setdefault((short, "gradient", step), []).append(
                g.detach().reshape(-1).tolist()))
        module.register_forward_hook(hook)


def _train(rank: int, world: int, root: str) -> dict:
    import torch

    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR

    cfg = dm.MetricsConfig(output_dir=f"{root}/dp", log_interval=4, console=False, timing_log_level=-1,
                           tensorboard=True, tensor_inspect={"enabled": True, "features": SHIPPED,
                                                             "feature_dirs": [FEATURES_DIR],
                                                             "allow_custom_feature_dirs": True})
    dm.inspect.initialize(cfg)  # before the model, as TE layers need
    model = _model()
    monitor = dm.Monitor(cfg, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: dict = {}
    step_box = [0]
    _capture(model, seen, step_box)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        step_box[0] = step
        for _ in range(MICRO):
            x = torch.randn(4, 8, generator=gen)
            x[0, :3] = x[0, :3] * 1e-6  # values FP8 current scaling flushes to zero: underflows% > 0
            model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(step, loss=0.0)
    monitor.close()
    return {"seen": {"|".join(map(str, k)): v for k, v in seen.items()}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("te_cpu")
    return root, run_ranks(_train, 2, str(root), timeout=240)


def _e4m3(x):
    """The test's own current-scaling E4M3 round trip (scale and dequantized values in float32,
    the layer's precision, as TE keeps them)."""
    import torch

    x32 = x.to(torch.float32)
    amax = x32.abs().max()
    scale = 448.0 / amax if amax > 0 else torch.tensor(1.0)
    scale_inv = 1.0 / scale
    deq = (x32 * scale).to(torch.float8_e4m3fn).to(torch.float32) * scale_inv
    return deq.to(torch.float64), float(scale_inv)


def _plain(values, stat):
    import torch

    x = torch.tensor(values, dtype=torch.float64)
    amax = x.abs().max().item()
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(), "std": x.std().item(),
            "l1_norm": x.abs().sum().item(), "l2_norm": x.norm().item(), "cur_amax": amax,
            "dynamic_range": math.log2(amax) - math.log2(x.abs()[x != 0].min().item())}[stat]


def _fp8(pieces, stat):
    """FP8 statistics over several tensors, each quantized with its own scale."""
    import torch

    n = under = sq = 0.0
    scale_invs = []
    for values in pieces:
        x = torch.tensor(values, dtype=torch.float64)
        deq, scale_inv = _e4m3(x)
        n += x.numel()
        under += ((x != 0) & (deq == 0)).sum().item()
        sq += (x - deq).pow(2).sum().item()
        scale_invs.append(scale_inv)
    return {"underflows%": 100.0 * under / n, "mse": sq / n, "scale_inv_min": min(scale_invs),
            "scale_inv_max": max(scale_invs)}[stat]


PLAIN = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
FP8 = ("underflows%", "scale_inv_min", "scale_inv_max", "mse")


def test_shipped_fp8_features_reach_jsonl_at_their_steps_with_exact_values(run):
    import distmetrics as dm

    root, results = run
    records = list(dm.read_jsonl(root / "dp" / "metrics.jsonl"))
    stats = {r["step"]: r for r in records if r["kind"] == "tensor_stats"}
    assert sorted(stats) == list(STATS_STEPS)
    seen = [{tuple(k.split("|")): v for k, v in r["seen"].items()} for r in results]
    checked = 0
    for step in STATS_STEPS:
        record = stats[step]
        names = {k for k in record if k.startswith("tensor_stats/")}
        assert names == {f"tensor_stats/mlp.linear_{short}/{tensor}/{stat}" for short in ("fc1", "fc2")
                         for tensor in ("activation", "gradient", "weight") for stat in PLAIN + FP8}
        for short in ("fc1", "fc2"):
            for tensor in ("activation", "gradient", "weight"):
                if tensor == "weight":
                    # TE feeds a weight once per step and does not reduce it: the writer shows
                    # the lowest rank's (data-parallel replicas hold the same weight).
                    pieces = seen[0][(short, tensor, str(step))][:1]
                else:
                    pieces = [p for rank in seen for p in rank[(short, tensor, str(step))]]
                assert len(pieces) == (1 if tensor == "weight" else 2 * MICRO)
                flat = [v for p in pieces for v in p]
                prefix = f"tensor_stats/mlp.linear_{short}/{tensor}"
                for stat in PLAIN:
                    assert record[f"{prefix}/{stat}"] == pytest.approx(_plain(flat, stat), rel=1e-9), (prefix, stat)
                    checked += 1
                for stat in FP8:
                    assert record[f"{prefix}/{stat}"] == pytest.approx(_fp8(pieces, stat), rel=1e-9, abs=1e-12), \
                        (prefix, stat)
                    checked += 1
        assert record["tensor_stats/mlp.linear_fc1/activation/underflows%"] > 0
    assert checked == 2 * 2 * 3 * 12
    # Not written again with a log step's record.
    assert not any(k.startswith("tensor_stats/") for r in records if r["kind"] == "train" for k in r)


def test_fp8_statistics_reach_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = run
    acc = EventAccumulator(str(root / "dp" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tag = "tensor_stats/mlp.linear_fc2/gradient/mse"
    assert tag in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars(tag)] == list(STATS_STEPS)
    assert "tensor_stats/mlp.linear_fc1/activation/underflows%" in acc.Tags()["scalars"]


STAGE_FEATURES = {"fp8": {"enabled": True, "layers": {"layer_name_regex_pattern": r".*linear_fc\d$"},
                          "transformer_engine": {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"],
                                                                       "stats": ["fp8_current_scaling_mse"],
                                                                       "freq": 1}}}}


def _stages(rank: int, world: int, root: str) -> dict:
    """Two pipeline stages holding different TE layers; only the last rank writes."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR, Fp8Linear

    class Stage(nn.Module):
        def __init__(self, index):
            super().__init__()
            setattr(self, f"linear_fc{index}", Fp8Linear(4, 4))

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    cfg = dm.MetricsConfig(output_dir=f"{root}/stages", writer_rank="last", log_interval=1, console=False,
                           tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": STAGE_FEATURES, "feature_dirs": [FEATURES_DIR],
                                           "allow_custom_feature_dirs": True})
    dm.inspect.initialize(cfg)
    torch.manual_seed(rank)
    model = Stage(rank + 1)
    monitor = dm.Monitor(cfg, model=model, device_mesh=mesh)
    layer = getattr(model, f"linear_fc{rank + 1}")
    x = torch.randn(3, 4)
    layer(x)
    monitor.step(1)
    monitor.close()
    return {"x": x.reshape(-1).tolist()}


def test_fp8_statistics_of_every_pipeline_stage_reach_the_writer(tmp_path):
    import distmetrics as dm

    results = run_ranks(_stages, 2, str(tmp_path))
    record = [r for r in dm.read_jsonl(tmp_path / "stages" / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    for rank in (0, 1):
        name = f"tensor_stats/linear_fc{rank + 1}/activation/fp8_current_scaling_mse"
        assert record[name] == pytest.approx(_fp8([results[rank]["x"]], "mse"), rel=1e-9)


def test_transformer_engine_key_needs_te_or_a_folder_that_registers_it(tmp_path):
    """Without TE and without a feature folder, the TE key is refused before anything starts;
    a custom folder is accepted only when allowed, and nvdlfw-inspect's own rejection of a
    feature the folders do not register becomes a clear error, not its SystemExit."""
    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR

    base = {"output_dir": str(tmp_path), "console": False, "json_log": False, "log_progress": False,
            "tensorboard": False}
    with pytest.raises(ValueError, match="needs TransformerEngine .* or a feature folder"):
        dm.Monitor(dm.MetricsConfig(**base, tensor_inspect={"enabled": True, "features": SHIPPED}), model=_model())
    with pytest.raises(ValueError, match="custom feature folders run code"):
        dm.Monitor(dm.MetricsConfig(**base, tensor_inspect={"enabled": True, "features": SHIPPED,
                                                            "feature_dirs": [FEATURES_DIR]}), model=_model())
    unknown = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
                     "transformer_engine": {"LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"],
                                                                    "stats": ["underflows%"]}}}}
    with pytest.raises(ValueError, match="nvdlfw-inspect rejected the features"):
        dm.Monitor(dm.MetricsConfig(**base, tensor_inspect={"enabled": True, "features": unknown,
                                                            "feature_dirs": [FEATURES_DIR],
                                                            "allow_custom_feature_dirs": True}), model=_model())
    import nvdlfw_inspect.api as debug_api

    assert debug_api.DEBUG_MANAGER is None


def _te_section(**settings) -> dict:
    """One section with TE's LogTensorStats of linear_fc1's activation (max), ``settings`` changed
    (None: removed)."""
    feature = {"enabled": True, "tensors": ["activation"], "stats": ["max"], **settings}
    return {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r".*linear_fc1$"},
                  "transformer_engine": {"LogTensorStats": {k: v for k, v in feature.items() if v is not None}}}}


@pytest.mark.parametrize("settings,message", [
    ({"freq": 0}, "transformer_engine.LogTensorStats for tensor 'activation': freq must be a whole number of steps "
                  ">= 1, got 0"),
    ({"freqq": 3}, "unknown key(s) ['freqq'] in transformer_engine.LogTensorStats; did you mean 'freq'?"),
    ({"start_step": 10, "end_step": 2}, "transformer_engine.LogTensorStats end_step 2 for tensor 'activation' is "
                                        "before start_step 10: no step is selected (end_step -1 or left out: no "
                                        "end)"),
    ({"end_step": -2}, "transformer_engine.LogTensorStats end_step for tensor 'activation' must be a whole step "
                       "number (end_step -1 or left out: no end), got -2"),
    ({"start_end_list": [[5, 3]]}, "transformer_engine.LogTensorStats start_end_list for tensor 'activation' must "
                                   "be a list of [start, end] step pairs, each selecting start <= step <= end (both "
                                   "ends included; end -1: no end; start <= end), got [[5, 3]]"),
    ({"stats": []}, "transformer_engine.LogTensorStats stats must be a non-empty list of statistics"),
    ({"stats": [3]}, "transformer_engine.LogTensorStats stat 3 for tensor 'activation' is not a statistic's name"),
    ({"enabled": None}, "transformer_engine.LogTensorStats needs 'enabled' (true or false)"),
    ({"tensors": None, "tensors_struct": [{"tensor": "activation", "stats": ["max"], "frq": 2}]},
     "unknown key(s) ['frq'] in a transformer_engine.LogTensorStats.tensors_struct entry; did you mean 'freq'?"),
], ids=["freq 0", "typo", "end before start", "end -2", "pair end before start", "no stats", "stat not text",
        "no enabled", "entry typo"])
def test_transformer_engine_logging_features_are_checked_as_te_reads_them(settings, message):
    """TE's LogTensorStats and LogFp8TensorStats were checked only for TE being there: ``freq: 0``
    passed and every rank died at the first monitor.step with a ZeroDivisionError naming nothing;
    a typo, an end before the start and an empty stats list were taken and logged nothing. Each is
    refused naming the file, section, feature and key, in both features."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    for feature in ("LogTensorStats", "LogFp8TensorStats"):
        features = _te_section(**settings)
        body = features["s"]["transformer_engine"]
        body[feature] = body.pop("LogTensorStats")
        with pytest.raises(ConfigError, match=re.escape(message.replace("LogTensorStats", feature))) as raised:
            load_features(features, te_available=True)
        assert str(raised.value).startswith("<inline features>: section 's': ")


def test_a_transformer_engine_freq_of_0_is_refused_when_the_monitor_is_built(tmp_path):
    """The symptom as it was met: the Monitor started, and every rank raised ZeroDivisionError in
    the schedule at its first ``monitor.step``. Now the Monitor is refused, nothing left running."""
    import nvdlfw_inspect.api as debug_api

    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": _te_section(freq=0),
                                           "feature_dirs": [FEATURES_DIR], "allow_custom_feature_dirs": True})
    with pytest.raises(ValueError, match=r"section 's': transformer_engine.LogTensorStats for tensor 'activation': "
                                         r"freq must be a whole number of steps >= 1, got 0"):
        dm.Monitor(cfg, model=_model())
    assert debug_api.DEBUG_MANAGER is None


def _te_selects(schedule: dict, iteration: int) -> bool:
    """TransformerEngine's reading of a schedule (its ``next_enabled_iter``): ends included, start
    0 and no end where left out, a start_end_list in place of start_step and end_step."""
    intervals = schedule.get("start_end_list") or [(schedule.get("start_step", 0),
                                                    schedule.get("end_step", math.inf))]
    intervals = [(s, math.inf if e == -1 else e) for s, e in intervals]  # -1: no end (TE on nvdlfw's schedule)
    return iteration % schedule.get("freq", 1) == 0 and any(s <= iteration <= e for s, e in intervals)


@pytest.mark.parametrize("schedule", [
    {"start_end_list": [[0, 10]]}, {"start_end_list": [[10, 10]]}, {"start_end_list": [[3, 9]], "freq": 3},
    {"start_end_list": [[0, 4], [9, 12]], "freq": 5}, {"start_end_list": [[11, 14]], "freq": 5},
    {"start_step": 2, "end_step": 10}, {"start_step": 8, "end_step": 9, "freq": 5}, {"start_step": 12, "freq": 7},
    {"start_step": 3, "end_step": -1, "freq": 4}, {"start_end_list": [[2, -1]], "freq": 50},
])
def test_a_transformer_engine_schedule_is_refused_exactly_when_te_selects_no_iteration(schedule):
    """TE includes a start_end_list pair's end (nvdlfw-inspect does not): ``[[0, 10]]`` selects
    iteration 10, ``[[10, 10]]`` that one iteration; both are taken with init_training_step 10."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    init = 10
    features = _te_section(**schedule)
    if any(_te_selects(schedule, i) for i in range(init, init + 100)):
        load_features(features, te_available=True, init_training_step=init)
    else:
        with pytest.raises(ConfigError, match=r"selects no step"):
            load_features(features, te_available=True, init_training_step=init)


def test_transformer_engine_statistic_names_and_other_features_are_left_to_te():
    """Stat names vary by TE version and recipe, so TE checks them at its first selected step (a stat
    may be a mapping of one to its settings, as in TE's blockwise statistics); its
    features that log nothing (DisableFP8GEMM and the like) have keys of their own. Beside them, a
    logging feature's schedule is still checked."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    features = _te_section(stats=["fp8_current_scaling_underflows%", "a_name_of_a_later_te",
                                  {"max_blockwise_dynamic_range": {"block_size": 32, "dims": 1}}], end_step=None)
    features["s"]["transformer_engine"]["DisableFP8GEMM"] = {"enabled": True, "gemms": ["fprop", "dgrad"]}
    load_features(features, te_available=True)
    features["s"]["transformer_engine"]["LogTensorStats"]["freq"] = 0
    with pytest.raises(ConfigError, match="transformer_engine.LogTensorStats for tensor 'activation': freq must be"):
        load_features(features, te_available=True)


def test_only_transformer_engine_logging_features_make_a_statistics_step():
    """A DisableFP8GEMM (no freq: every step) counted as a logging feature made every step a
    statistics step, each with an all-gather; only TE's Log* features' schedules decide."""
    from distmetrics.tensor_stats.schedule import stats_step

    features = _te_section(freq=10)
    features["s"]["transformer_engine"]["DisableFP8GEMM"] = {"enabled": True, "gemms": ["fprop"]}
    assert [i for i in range(30) if stats_step(features, i)] == [0, 10, 20]
    del features["s"]["transformer_engine"]["LogTensorStats"]
    assert not any(stats_step(features, i) for i in range(30))


def test_a_model_factory_is_built_after_inspection_starts(tmp_path):
    """Given a factory, the Monitor starts nvdlfw-inspect first (TE decides at construction
    whether a layer is inspected), then builds the model and optimizer; one process."""
    import torch
    import nvdlfw_inspect.api as debug_api

    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR

    def factory():
        assert debug_api.DEBUG_MANAGER is not None, "inspection must be running before the layers are built"
        model = _model()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, log_update_norm=True,
                           tensor_inspect={"enabled": True, "features": STAGE_FEATURES, "feature_dirs": [FEATURES_DIR],
                                           "allow_custom_feature_dirs": True})
    x = torch.randn(3, 8)
    with dm.Monitor(cfg, model=factory) as monitor:
        assert isinstance(monitor.optimizer, torch.optim.SGD)
        monitor.model(x).sum().backward()
        monitor.optimizer.step()
        monitor.step(1)
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    assert record["tensor_stats/mlp.linear_fc1/activation/fp8_current_scaling_mse"] == \
        pytest.approx(_fp8([x.reshape(-1).tolist()], "mse"), rel=1e-9)
    train = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][0]
    assert train["update_norm"] > 0  # the optimizer the factory returned is hooked
    assert debug_api.DEBUG_MANAGER is None

    with pytest.raises(TypeError, match="the model factory returned str"):
        dm.Monitor(cfg, model=lambda: "not a model")
    assert debug_api.DEBUG_MANAGER is None  # the failed build left nothing running


def _groups(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distmetrics.parallel import data_parallel_group, detect_layout

    out = {}
    for key, shape, names in (("dp_tp", (2, 2), ("dp", "tp")), ("hsdp", (2, 2), ("dp_replicate", "dp_shard")),
                              ("pp_tp", (2, 2), ("pp", "tp"))):
        group = data_parallel_group(detect_layout(init_device_mesh("cpu", shape, mesh_dim_names=names)))
        out[key] = dist.get_process_group_ranks(group)
    out["no_mesh"] = data_parallel_group(detect_layout())
    return out


def test_the_reduction_group_is_the_data_parallel_peers():
    """What the Monitor hands nvdlfw-inspect as the tensor reduction group, on 4 ranks."""
    results = run_ranks(_groups, 4)
    for rank, r in enumerate(results):
        assert r["dp_tp"] == [rank % 2, rank % 2 + 2]   # mesh [[0, 1], [2, 3]]: dp is the column
        assert r["hsdp"] == [0, 1, 2, 3]                # both dp dimensions, flattened
        assert r["pp_tp"] == [rank]                     # no data parallelism: the rank alone
        assert r["no_mesh"] is None                     # plain data parallelism: the world
