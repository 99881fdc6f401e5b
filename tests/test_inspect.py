"""Tensor statistics through the real nvdlfw-inspect (0.2.2) on 2 gloo ranks, compared with
statistics computed independently in float64 on the full tensors (all micro-batches of all
ranks gathered), and read back from JSONL, TensorBoard and a W&B offline run."""

import math
import re
import textwrap
from pathlib import Path
from typing import Optional

import pytest

from tests.dist_utils import run_python, run_ranks

FEATURES = textwrap.dedent("""
    fc_stats:
      enabled: true
      layers:
        layer_name_regex_pattern: "fc1$"
      distmetrics:
        LogTensorStats:
          enabled: true
          tensors_struct:
            - tensor: activation
              stats: [min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range]
              freq: 2
              start_step: 2
              end_step: 6
            - tensor: gradient
              stats: [mean, std, l2_norm]
              freq: 2
              start_step: 2
              end_step: 6
            - tensor: weight
              stats: [std, l2_norm]
              freq: 2
              start_step: 2
              end_step: 6
""")
STEPS = 8
MICRO = 2


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 12)
            self.fc2 = nn.Linear(12, 3)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    return Net()


def _train(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    features = Path(root) / "features.yaml"
    if rank == 0:
        features.write_text(FEATURES)
    dist.barrier()
    model = _model()
    captured = {"activation": [], "gradient": []}

    def spy(mod, inputs, output):  # the test's own capture: ground truth
        captured["activation"].append(output.detach().clone())
        output.register_hook(lambda g: captured["gradient"].append(g.detach().clone()))

    cfg = dm.MetricsConfig(output_dir=f"{root}/out{rank}", log_interval=4, console=False, timing_log_level=-1,
                           wandb_project="inspect-test", wandb_mode="offline",
                           tensor_inspect={"enabled": True, "features": str(features)})
    monitor = dm.Monitor(cfg, model=model)
    truth = {}
    for step in range(1, STEPS + 1):
        iteration = step - 1
        handle = model.fc1.register_forward_hook(spy)
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(5 + rank, 6, generator=g)  # ranks hold different batch sizes
            model(x).pow(2).mean().backward()
        handle.remove()
        weight = model.fc1.weight.detach().clone()
        if iteration in (2, 4, 6):
            truth[step] = {name: _gather(torch.cat([t.reshape(-1) for t in ts])) for name, ts in captured.items()}
            truth[step]["weight"] = weight.reshape(-1).to(torch.float64)
        captured = {"activation": [], "gradient": []}
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        monitor.step(step, loss=1.0)
    monitor.close()
    import nvdlfw_inspect.api as debug_api

    # plain lists: tensors would travel through shared memory that dies with this process
    truth = {step: {name: t.tolist() for name, t in tensors.items()} for step, tensors in truth.items()}
    return {"truth": truth, "closed": debug_api.DEBUG_MANAGER is None}


def _gather(t):
    import torch
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()  # ranks hold different sizes: gather as objects
    dist.all_gather_object(parts, t)
    return torch.cat(parts).to(torch.float64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    return root, run_ranks(_train, 2, str(root), timeout=240)


def _expected(values, stat):
    import torch

    t = torch.tensor(values, dtype=torch.float64)
    if stat == "std":
        return float(t.std())
    if stat == "l1_norm":
        return float(t.abs().sum())
    if stat == "l2_norm":
        return float(t.pow(2).sum().sqrt())
    if stat == "cur_amax":
        return float(t.abs().max())
    if stat == "dynamic_range":
        nonzero = t.abs()[t != 0]
        return math.log2(float(nonzero.max())) - math.log2(float(nonzero.min()))
    return float(getattr(torch, stat)(t))


def test_statistics_equal_those_of_the_full_tensors(run):
    import distmetrics as dm

    root, results = run
    records = {r["step"]: r for r in dm.read_jsonl(root / "out0" / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    truth = results[0]["truth"]
    for step, tensors in truth.items():
        record = records[step]
        for tensor_name, stats in (("activation", ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax",
                                                   "dynamic_range"]),
                                   ("gradient", ["mean", "std", "l2_norm"]), ("weight", ["std", "l2_norm"])):
            for stat in stats:
                got = record[f"tensor_stats/fc1/{tensor_name}/{stat}"]
                assert got == pytest.approx(_expected(tensors[tensor_name], stat), rel=1e-9, abs=1e-12), \
                    (step, tensor_name, stat)


def test_freq_start_and_end_are_respected(run):
    import distmetrics as dm

    root, _ = run
    steps = [r["step"] for r in dm.read_jsonl(root / "out0" / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert steps == [3, 5, 7]  # iterations 2, 4, 6 (the first step is iteration 0)


def test_every_sink_receives_the_statistics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.wandb_reader import read_offline_run

    root, _ = run
    acc = EventAccumulator(str(root / "out0" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("tensor_stats/fc1/activation/std")] == [3, 5, 7]
    wb = read_offline_run(str(root / "out0"))
    rows = [row for row in wb["history"] if "tensor_stats/fc1/gradient/l2_norm" in row]
    assert [row["step"] for row in rows] == [3, 5, 7]
    # only the writer writes metrics; nvdlfw-inspect keeps its own per-rank debug log in log_dir
    assert [p.relative_to(root / "out1").as_posix() for p in (root / "out1").rglob("*") if p.is_file()] == \
        ["tensor_inspect/nvdlfw_inspect_logs/nvdlfw_inspect_globalrank-1.log"]


def test_nvdlfw_is_shut_down_at_close(run):
    _, results = run
    assert all(r["closed"] for r in results)


# --- pipeline stages: each stage's layers reach the writer ------------------------------------

STAGE_FEATURES = {"all_linear": {"enabled": True, "layers": {"layer_name_regex_pattern": r"layers\.\d+\.proj$"},
                                 "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                                     "stats": ["mean"], "freq": 1}}}}


def _stages(rank: int, world: int, root: str) -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    class Layer(nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number  # global, as Megatron numbers them
            self.proj = nn.Linear(4, 4)

    class Stage(nn.Module):
        def __init__(self, numbers):
            super().__init__()
            self.layers = nn.ModuleList(Layer(n) for n in numbers)

        def forward(self, x):
            for layer in self.layers:
                x = layer.proj(x)
            return x

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    model = Stage([1, 2] if rank == 0 else [3, 4])

    def run(features, out):
        cfg = dm.MetricsConfig(output_dir=f"{root}/{out}", writer_rank="last", log_interval=1, console=False,
                               tensorboard=False, timing_log_level=-1,
                               tensor_inspect={"enabled": True, "features": features})
        try:
            monitor = dm.Monitor(cfg, model=model, device_mesh=mesh)
        except ValueError as err:
            return str(err)
        model(torch.ones(2, 4))
        monitor.step(1)
        monitor.close()
        return None

    return {"all": run(STAGE_FEATURES, "stages"), "first_only": run(FIRST_STAGE_ONLY, "first_only"),
            "nowhere": run(dict(FIRST_STAGE_ONLY, **NOWHERE), "nowhere")}


FIRST_STAGE_ONLY = {"first": {"enabled": True, "layers": {"layer_name_regex_pattern": r"layers\.1\.proj$"},
                              "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                                  "stats": ["mean"], "freq": 1}}}}
NOWHERE = {"typo": {"enabled": True, "layers": {"layer_name_regex_pattern": r"layers\.1\.porj$"},
                    "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}}}


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return root, run_ranks(_stages, 2, str(root))


def test_statistics_of_every_pipeline_stage_reach_the_writer(stages):
    import distmetrics as dm

    root, results = stages
    assert results[0]["all"] is None and results[1]["all"] is None
    record = [r for r in dm.read_jsonl(root / "stages" / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    layers = sorted(k for k in record if k.startswith("tensor_stats/"))
    assert layers == [f"tensor_stats/layers.{n}.proj/activation/mean" for n in (1, 2, 3, 4)]


def test_a_section_selecting_layers_of_one_stage_only_is_fine(stages):
    """The last stage holds no layer the section selects; it must neither raise nor hang, and
    the first stage's statistics reach the writer on the last rank."""
    import distmetrics as dm

    root, results = stages
    assert results[0]["first_only"] is None and results[1]["first_only"] is None
    record = [r for r in dm.read_jsonl(root / "first_only" / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    assert sorted(k for k in record if k.startswith("tensor_stats/")) == ["tensor_stats/layers.1.proj/activation/mean"]


def test_a_section_selecting_no_layer_on_any_rank_raises_on_every_rank(stages):
    _, results = stages
    for rank in (0, 1):
        assert "section(s) ['typo'] select no layer of the model on any rank" in results[rank]["nowhere"]


# --- bad input: clear errors before training, never SystemExit -------------------------------

def _monitor_with(features, tmp_path, **extra):
    import distmetrics as dm

    ti = {"enabled": True, "features": features}
    ti.update(extra)
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), json_log=False, console=False, log_progress=False,
                           tensorboard=False, tensor_inspect=ti)
    return dm.Monitor(cfg, model=_model())


def _section(layers: Optional[dict] = None, feature: Optional[dict] = None, namespace: Optional[str] = "distmetrics"):
    """A features mapping of one section: LogTensorStats of fc1's activation (its mean) with
    ``feature``'s keys changed (None: removed), in ``namespace`` (None: nvdlfw-inspect's base)."""
    settings = {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}
    settings.update(feature or {})
    settings = {k: v for k, v in settings.items() if v is not None}
    section = {"enabled": True, "layers": layers or {"layer_name_regex_pattern": "fc1"}}
    section.update({namespace: {"LogTensorStats": settings}} if namespace else {"LogTensorStats": settings})
    return {"s": section}


@pytest.mark.parametrize("features,message", [
    ("/nonexistent/features.yaml", "file '/nonexistent/features.yaml' does not exist"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "nothing-matches"},
            "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}}}},
     "select no layer of the model on any rank"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
            "distmetrics": {"LogHistogram": {"enabled": True}}}}, "unknown feature 'distmetrics.LogHistogram'"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
            "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["median"]}}}},
     "distmetrics.LogTensorStats stat 'median' for tensor 'activation' is not one of"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
            "transformer_engine": {"LogFp8TensorStats": {"enabled": True}}}},
     "key 'transformer_engine' needs TransformerEngine"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"}, "Bogus": {}}}, "unknown key 'Bogus'"),
    ({"s": {"enabled": True}}, "'layers' needs one of"),
    # raised from inside nvdlfw-inspect (re.error, left running), read letter by letter (f|c|1 takes
    # fc2 too), a schedule null that raised a TypeError mid-training, a feature that logged nothing:
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc(1"},
            "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}}}},
     r"layer_name_regex_pattern 'fc\(1' is not a regular expression"),
    ({"s": {"enabled": True, "layers": {"layer_types": "fc1"},
            "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}}}},
     "layers.layer_types must be a list of names such as"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
            "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"],
                                               "start_step": 2, "end_step": None}}}},
     "end_step for tensor 'activation' has no value"),
    ({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
            "distmetrics": {"LogTensorStats": {"tensors": ["activation"], "stats": ["mean"]}}}},
     "distmetrics.LogTensorStats needs 'enabled'"),
    ({name: {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
             "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}}}
      for name in ("a", "b")}, "sections 'a' and 'b' both select layer 'model.fc1', and nvdlfw-inspect takes one "
                               "section per layer"),
    # accepted, and nvdlfw-inspect then ignored the key (the section's other selector chose every
    # layer of layer 1), failed inside its start, read the tensor's first entry only (the second's
    # statistics never came), selected no step, or read the empty tensors_struct and logged nothing:
    (_section({"layer_numbers": [1], "layer_type": ["fc1"]}), r"unknown key\(s\) \['layer_type'\] in layers"),
    (_section({"layer_numbers": 1}), "layers.layer_numbers must be a list of layer numbers and ranges"),
    (_section(feature={"tensors": None, "tensors_struct": [{"tensor": "activation", "stats": ["max"]},
                                          {"tensor": "activation", "stats": ["std"]}]}),
     "tensor 'activation' is listed twice in distmetrics.LogTensorStats"),
    (_section(feature={"start_end_list": [[1, 2]], "freq": 2}),
     r"selects no step: no multiple of freq 2 lies in start_end_list \[\[1, 2\]\]"),
    (_section(feature={"start_step": 3, "end_step": 3, "freq": 2}),
     "selects no step: no multiple of freq 2 lies in start_step 3 to end_step 3"),
    (_section(feature={"tensors_struct": []}), "has both 'tensors' and 'tensors_struct'"),
    # a pattern took every layer it matched, the numbers or types beside it ignored; an empty list
    # said to be missing; every section off: "Could not load config from input"
    (_section({"layer_name_regex_pattern": "fc", "layer_numbers": [1]}),
     "layer_name_regex_pattern selects alone: nvdlfw-inspect ignores layer_numbers beside it"),
    (_section({"layer_name_regex_pattern": "fc", "layer_types": ["fc1"]}), "ignores layer_types beside it"),
    (_section(feature={"tensors": None, "tensors_struct": []}), r"LogTensorStats.tensors_struct is empty"),
    ({"s": {**_section()["s"], "enabled": False}}, "every section has enabled: false, so nothing would be inspected"),
    (_section(namespace=None, feature={"frequency": 2}), r"unknown key\(s\) \['frequency'\] in LogTensorStats;"),
    (_section(namespace=None, feature={"tensors": None, "tensors_struct": [{"tensor": "activation", "freqq": 2}]}),
     r"unknown key\(s\) \['freqq'\] in a LogTensorStats.tensors_struct entry"),
    # an enabled section whose features are all off measured nothing, without a word
    (_section(feature={"enabled": False}), "the section is enabled and none of its features is, so it would measure"),
    # a range ending before it starts selected nothing, without a word
    (_section({"layer_numbers": [1, "3-1"]}), r"layers.layer_numbers must be a list .* got \[1, '3-1'\]"),
])
def test_bad_features_fail_before_training_with_a_clear_error(tmp_path, features, message):
    import nvdlfw_inspect.api as debug_api

    with pytest.raises(ValueError, match=message):
        _monitor_with(features, tmp_path)
    assert debug_api.DEBUG_MANAGER is None  # nothing left running


_STRUCT_WITHOUT_TENSOR = {"tensors": None, "tensors_struct": [{"stats": ["max"]}]}


@pytest.mark.parametrize("features,init,message", [
    (_section({"layer_name_regex": "fc1"}), 0,
     "section 's': unknown key(s) ['layer_name_regex'] in layers; did you mean 'layer_name_regex_pattern'?"),
    (_section(feature=_STRUCT_WITHOUT_TENSOR), 0,
     "section 's': the 'tensor' key is missing in the distmetrics.LogTensorStats.tensors_struct entry"),
    (_section(namespace=None, feature=_STRUCT_WITHOUT_TENSOR), 0,
     "section 's': the 'tensor' key is missing in the LogTensorStats.tensors_struct entry"),
    (_section(namespace=None, feature={"freq": 0}), 0,
     "section 's': LogTensorStats for tensor 'activation': freq must be a whole number of steps >= 1, got 0"),
    (_section(feature={"tensors": ["input"], "start_step": 2, "end_step": 4}), 10,
     "section 's': distmetrics.LogTensorStats for tensor 'input' selects no step of this job: no multiple of freq "
     "1 in start_step 2 to end_step 4 is at or after tensor_inspect.init_training_step 10"),
    (_section(namespace=None, feature={"start_end_list": [[0, 10]]}), 10,
     "section 's': LogTensorStats for tensor 'activation' selects no step of this job: no multiple of freq 1 in "
     "start_end_list [[0, 10]] is at or after tensor_inspect.init_training_step 10"),
    # nvdlfw-inspect's own feature: a bare TypeError (unhashable type: 'list'), from check-features a traceback
    (_section(namespace=None, feature={"tensors": [["activation"]]}), 0,
     "section 's': tensor ['activation'] in LogTensorStats is not a tensor's name (text, such as activation)"),
    (_section(namespace=None, feature={"tensors": None, "tensors_struct": [{"tensor": {"a": 1}, "stats": ["max"]}]}),
     0, "section 's': tensor {'a': 1} in LogTensorStats is not a tensor's name"),
], ids=["layers typo alone", "entry without tensor", "base entry without tensor", "freq 0",
        "end before init_training_step", "start_end_list before init_training_step", "tensor a list",
        "tensor a mapping"])
def test_a_features_error_names_the_section_feature_tensor_and_key(tmp_path, capsys, features, init, message):
    """A typo that was the only key of ``layers`` was reported as a missing selector; an entry
    without ``tensor`` as ``tensor None``; ``freq: 0`` without its feature and tensor; and a
    schedule that ends before init_training_step was accepted and logged nothing. The Monitor,
    check-config and check-features say the same."""
    import yaml

    from distmetrics.cli import main

    with pytest.raises(ValueError, match=re.escape(message)):
        _monitor_with(features, tmp_path, init_training_step=init)
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(features))
    commands = [["check-config", str(Path(__file__).resolve().parents[1] / "configs" / "metrics.yaml"),
                 "tensor_inspect.enabled=true", f"tensor_inspect.features={path}",
                 f"tensor_inspect.init_training_step={init}"]]
    commands += [["check-features", str(path)]] if init == 0 else []
    for argv in commands:
        capsys.readouterr()
        status, err = main(argv), capsys.readouterr().err
        assert status == 2 and message in err and str(path) in err, (argv, err)


def test_layer_numbers_all_in_any_case_and_start_end_beside_a_list_are_taken_as_nvdlfw_inspect_takes_them(tmp_path):
    """'ALL' (nvdlfw-inspect lower-cases it) was refused; start_step after end_step beside start_end_list, which
    nvdlfw-inspect then ignores, was refused as selecting no step."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    load_features(_section({"layer_numbers": "ALL", "layer_types": ["fc1"]}), te_available=False)
    _monitor_with(_section(feature={"start_step": 5, "end_step": 2, "start_end_list": [[0, 10]]}), tmp_path).close()
    with pytest.raises(ConfigError, match="end_step 2 for tensor 'activation' is before start_step 5"):
        _monitor_with(_section(feature={"start_step": 5, "end_step": 2}), tmp_path)


@pytest.mark.parametrize("schedule", [
    {"start_step": 2, "end_step": 4}, {"start_step": 2, "end_step": 10}, {"start_step": 3, "end_step": 9, "freq": 5},
    {"start_step": 8, "end_step": 10, "freq": 5}, {"start_end_list": [[0, 10]]}, {"start_end_list": [[0, 11]]},
    {"start_end_list": [[0, 4], [9, 12]], "freq": 4}, {"start_end_list": [[0, 4], [9, 12]], "freq": 5},
    {"start_step": 3, "end_step": -1, "freq": 7}, {"freq": 3},
])
def test_a_schedule_is_refused_exactly_when_nvdlfw_inspect_selects_no_iteration_from_init_training_step(schedule):
    """nvdlfw-inspect counts iterations from init_training_step; the check counted from 0, so a
    schedule that ended before the job's first iteration passed and logged nothing."""
    from nvdlfw_inspect.logging import enable_logging_at_current_step

    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    init = 10
    logs = any(enable_logging_at_current_step(i, schedule.get("freq", 1), schedule.get("start_step", 0),
                                              schedule.get("end_step", -1), schedule.get("start_end_list"))
               for i in range(init, init + 100))
    for namespace in ("distmetrics", None):
        features = _section(namespace=namespace, feature=schedule)
        if logs:
            load_features(features, init_training_step=init)
        else:
            with pytest.raises(ConfigError, match=r"selects no step of this job: .*init_training_step 10,"):
                load_features(features, init_training_step=init)


def _from_init_training_step(rank: int, world: int, root: str) -> dict:
    import logging

    import torch
    import torch.distributed as dist

    import distmetrics as dm

    def config(features: dict) -> "dm.MetricsConfig":
        return dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                                hang_timeout_s=20, tensor_inspect={"enabled": True, "features": features,
                                                                   "init_training_step": 10,
                                                                   "log_dir": f"{root}/inspect{rank}"})

    fc1 = {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
           "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "std"],
                                              "start_step": 2, "end_step": 4}}}
    try:  # ends before the job's first iteration: refused on both ranks, before any collective
        dm.Monitor(config({"fc1": fc1}), model=_model()).close()
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    fc1["distmetrics"]["LogTensorStats"].update(start_step=10, end_step=11)  # iterations 10 and 11: steps 1 and 2
    typo = {"enabled": True, "layers": {"layer_name_regex_pattern": "fc2$"},
            "LogTensorStats": {"enabled": True, "tensors": ["activations"], "stats": ["max"]}}
    warnings: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    model = _model()
    seen: dict = {}
    model.fc1.register_forward_hook(lambda m, i, o: seen.setdefault(step, []).append(o.detach().double().reshape(-1)))
    with dm.Monitor(config({"fc1": fc1, "typo": typo}), model=model) as monitor:
        for step in (1, 2, 3):
            x = torch.randn(3 + rank, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).sum().backward()
            monitor.step(step)
    logging.getLogger("distmetrics").removeHandler(handler)
    parts = [None] * world
    dist.all_gather_object(parts, {s: torch.cat(v).tolist() for s, v in seen.items()})  # the truth, after the run
    return {"refused": refused, "warnings": [w for w in warnings if "no value came" in w], "truth": parts}


def test_statistics_count_from_init_training_step_and_an_unknown_base_tensor_is_named(tmp_path):
    """On 2 gloo ranks with init_training_step 10: a schedule ending at iteration 4 is refused on
    both ranks (it was accepted and logged nothing); one of iterations 10-11 logs steps 1 and 2,
    equal to the float64 statistics of both ranks' activations; and a base LogTensorStats tensor
    name the hooks do not measure (``activations``) is named, with the four they do, at the step
    records name (1), not nvdlfw-inspect's iteration alone."""
    import torch

    import distmetrics as dm

    results = run_ranks(_from_init_training_step, 2, str(tmp_path), timeout=150)
    for result in results:
        assert "distmetrics.LogTensorStats for tensor 'activation' selects no step of this job" in result["refused"]
        assert "start_step 2 to end_step 4 is at or after tensor_inspect.init_training_step 10" in result["refused"]
    stats = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    assert sorted(stats) == [1, 2]
    for step, record in stats.items():
        full = torch.tensor([v for rank in results[0]["truth"] for v in rank[step]], dtype=torch.float64)
        assert record["tensor_stats/fc1/activation/max"] == pytest.approx(float(full.max()), rel=1e-12)
        assert record["tensor_stats/fc1/activation/std"] == pytest.approx(float(full.std()), rel=1e-9)
        assert not any("fc2" in key for key in record)
    [warning] = results[0]["warnings"]
    assert results[1]["warnings"] == []  # said once, by the first rank
    for part in ("section 'typo' selects step 1 (nvdlfw-inspect's iteration 10)", "for tensor(s) 'activations'",
                 "measure activation, input, weight, gradient", "your own debug_api.log_tensor_stats calls"):
        assert part in warning, warning


def test_unparsable_features_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("s: [unclosed\n")
    with pytest.raises(ValueError, match=f"'{bad}' is not valid YAML"):
        _monitor_with(str(bad), tmp_path)


def test_custom_feature_dirs_are_refused_unless_allowed(tmp_path):
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                          "stats": ["mean"]}}}}
    with pytest.raises(ValueError, match="custom feature folders run code"):
        _monitor_with(features, tmp_path, feature_dirs=[str(tmp_path)])
    monitor = _monitor_with(features, tmp_path, feature_dirs=[str(tmp_path)], allow_custom_feature_dirs=True)
    monitor.close()


def test_shipped_feature_files_validate():
    from distmetrics.tensor_stats import load_features

    root = Path(__file__).resolve().parents[1] / "configs"
    load_features(str(root / "tensor_stats_cpu.yaml"))
    load_features(str(root / "fp8_tensor_stats.yaml"), te_available=True)
    with pytest.raises(ValueError, match="transformer_engine"):
        load_features(str(root / "fp8_tensor_stats.yaml"), te_available=False)


# --- values logged by nvdlfw-inspect's own features (as TransformerEngine's are) ---------------

def test_values_logged_through_nvdlfw_metric_logger_reach_the_sinks(tmp_path):
    """nvdlfw-inspect's base-namespace LogTensorStats reports through MetricLogger, exactly as
    TransformerEngine's features do: on the steps its YAML selects, its values are written with
    that step's tensor_stats record; a value logged on any other step rides the next log step."""
    import torch
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import MetricLogger

    import distmetrics as dm

    features = {"base_stats": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                               "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean", "max"],
                                                  "freq": 2}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    model = _model()
    x = torch.arange(12.0).reshape(2, 6)
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2, 3, 4):
            if step % 2 == 1:  # iterations 0 and 2: the YAML's stats steps
                debug_api.log_tensor_stats("model.fc1", tensor=x * step, tensor_name="activation",
                                           skip_reduction=True)
            if step == 2:      # iteration 1: not a stats step of any feature
                MetricLogger.log_scalar("model.fc2_weight_custom", torch.tensor(7.5), 1)
            monitor.step(step)
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    stats = {r["step"]: r for r in records if r["kind"] == "tensor_stats"}
    assert sorted(stats) == [1, 3]
    for step in (1, 3):
        assert stats[step]["tensor_stats/fc1/activation/mean"] == pytest.approx(float((x * step).mean()))
        assert stats[step]["tensor_stats/fc1/activation/max"] == pytest.approx(11.0 * step)
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert train[2]["tensor_stats/fc2/weight/custom"] == 7.5
    assert not any(k.startswith("tensor_stats/fc1") for k in train[2])
    assert not any(k.endswith("max_rank") for r in records for k in r if k.startswith("tensor_stats/"))


def test_a_value_logged_on_an_unselected_step_rides_the_next_log_step_not_the_next_selected_step(tmp_path):
    """With the log step past the next selected step, a value logged at an unselected step was taken
    into that selected step's tensor_stats record, under its step (step 2's value written as step 3's).
    It now waits for the next log step's train record, as the README says."""
    import torch
    from nvdlfw_inspect.logging import MetricLogger

    import distmetrics as dm

    features = {"base_stats": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                               "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"],
                                                  "freq": 2}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=4, console=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    model = _model()
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2, 3, 4):  # steps 1 and 3 (iterations 0 and 2) are the YAML's
            model(torch.ones(2, 6))
            if step in (2, 4):
                MetricLogger.log_scalar(f"model.fc2_weight_custom{step}", torch.tensor(float(step)), step - 1)
            monitor.step(step)
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    stats = {r["step"]: r for r in records if r["kind"] == "tensor_stats"}
    assert sorted(stats) == [1, 3] and not any("custom" in k for r in stats.values() for k in r), stats
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert train[4]["tensor_stats/fc2/weight/custom2"] == 2.0 and train[4]["tensor_stats/fc2/weight/custom4"] == 4.0


def _unselected_values_by_rank(rank: int, world: int, root: str) -> dict:
    import torch
    from nvdlfw_inspect.logging import MetricLogger

    import distmetrics as dm

    features = {"base_stats": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                               "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"],
                                                  "freq": 2}}}
    cfg = dm.MetricsConfig(output_dir=root, log_interval=2, console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    with dm.Monitor(cfg, model=_model()) as monitor:
        monitor.step(1)
        # iteration 1 is no stats step: each rank's own statistics of its own tensor (skip_reduction)
        low, high = ((400.0, 401.0), (390.0, 410.0))[rank]
        MetricLogger.log_scalar("model.fc2_probe_min", torch.tensor(low), 1)
        MetricLogger.log_scalar("model.fc2_probe_max", torch.tensor(high), 1)
        if rank == 1:
            MetricLogger.log_scalar("model.fc2_probe_mean", torch.tensor(395.0), 1)
        return monitor.step(2)


def test_values_logged_on_an_unselected_step_are_the_lowest_ranks_not_a_max_of_each_name(tmp_path):
    """Each name was reduced as a max over ranks: rank 0's min (400) beside rank 1's max (410), a pair no
    rank's tensor had; a selected step writes the lowest rank's values, and so does the log step now."""
    results = run_ranks(_unselected_values_by_rank, 2, str(tmp_path))
    for metrics in results:
        probe = {k: v for k, v in metrics.items() if "probe" in k}
        assert probe == {"tensor_stats/fc2/probe/min": 400.0, "tensor_stats/fc2/probe/max": 401.0,
                         "tensor_stats/fc2/probe/mean": 395.0}, probe


def _user_calls_on_plain_ranks(rank: int, world: int, root: str) -> dict:
    import nvdlfw_inspect.api as debug_api
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "LogTensorStats": {"enabled": True, "tensors": ["custom"], "stats": ["min", "l2_norm"]}}}
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    with dm.Monitor(cfg, model=_model()) as monitor:
        group = debug_api.get_tensor_reduction_group()
        mine = torch.arange(6.0).reshape(2, 3) - 10.0 * rank
        debug_api.log_tensor_stats("model.fc1", tensor=mine, tensor_name="custom")
        monitor.step(1)
    records = dm.read_jsonl(Path(root) / "metrics.jsonl") if rank == 0 else [{"kind": "tensor_stats"}]
    [record] = [r for r in records if r["kind"] == "tensor_stats"]
    return {"group": None if group is None else dist.get_process_group_ranks(group),
            "written": {k: v for k, v in record.items() if "custom" in k}}


def test_user_calls_on_a_plain_layout_reduce_over_the_monitors_ranks(tmp_path):
    """On a plain (DDP-like) layout no reduction group was set: nvdlfw-inspect warned at every call
    that it had none, and gathered on its last rank alone."""
    import torch

    full = torch.cat([torch.arange(6.0) - 10.0 * rank for rank in range(2)]).double()
    results = run_ranks(_user_calls_on_plain_ranks, 2, str(tmp_path))
    assert [result["group"] for result in results] == [[0, 1], [0, 1]]
    assert results[0]["written"] == pytest.approx({"tensor_stats/fc1/custom/min": float(full.min()),
                                                   "tensor_stats/fc1/custom/l2_norm": float(full.norm())})


def test_a_users_call_under_a_name_the_hooks_measure_is_said_once(tmp_path, caplog):
    """A ``debug_api.log_tensor_stats`` call of the user's (as nvdlfw-inspect's docs place it, in the forward)
    for the tensor the features file's hooks measure: the hooks' value overwrote the call's without a word.
    The hooks' value is written (truth: the layer's output, taken by the test's own hook) and the clash
    named once."""
    import logging

    import nvdlfw_inspect.api as debug_api
    import torch

    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}}
    model = _model()
    outputs = []
    model.fc1.register_forward_hook(lambda m, i, o: outputs.append(float(o.detach().double().max())))
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2):
            model(torch.randn(4, 6))
            debug_api.log_tensor_stats("model.fc1", tensor=torch.full((3,), 100.0), tensor_name="activation")
            monitor.step(step)
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert [r["tensor_stats/fc1/activation/max"] for r in records] == pytest.approx(outputs, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "log_tensor_stats call logged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("distmetrics: tensor_stats/fc1/activation/max at step 1:"), said


def test_transformer_engine_metric_names_map_to_ours():
    from distmetrics.tensor_stats.te_names import metric_name as _metric_name

    assert _metric_name("model.decoder.layers.1.self_attention.linear_qkv_activation_underflows%") == \
        "tensor_stats/decoder.layers.1.self_attention.linear_qkv/activation/underflows%"
    assert _metric_name("model.layers.0.mlp.linear_fc1_gradient_mxfp8_scale_inv_min") == \
        "tensor_stats/layers.0.mlp.linear_fc1/gradient/mxfp8_scale_inv_min"
    # A layer whose own name holds a tensor name is split at the known layer, not inside it.
    layers = {"model.pre_weight_proj", "model.pre_weight_proj.inner"}
    assert _metric_name("model.pre_weight_proj_activation_fp8_current_scaling_mse", layers) == \
        "tensor_stats/pre_weight_proj/activation/fp8_current_scaling_mse"
    assert _metric_name("model.pre_weight_proj.inner_gradient_underflows%", layers) == \
        "tensor_stats/pre_weight_proj.inner/gradient/underflows%"
    assert _metric_name("model.pre_weight_proj_activation_mse") == "tensor_stats/pre_weight_proj/activation/mse"
    # a layer name that is no module's (the user's own debug_api call: "fc1", or "model.fc1" under DDP's
    # "model.module.fc1"): split at the features file's tensor names too, the longest of those ending last
    tensors = ("scores", "attn_scores", "my_t")
    assert _metric_name("fc1_my_t_max", {"model.module.fc1": "fc1"}, tensors) == "tensor_stats/fc1/my_t/max"
    assert _metric_name("model.fc1_my_t_l2_norm", {"model.module.fc1": "fc1"}, tensors) == \
        "tensor_stats/fc1/my_t/l2_norm"
    assert _metric_name("attn_attn_scores_max", (), tensors) == "tensor_stats/attn/attn_scores/max"


def _wrapped(module):
    """``module`` inside a wrapper level named as DDP's (``module``), without a process group."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    return Wrapper(module)


def test_a_section_selecting_a_wrapper_level_name_is_not_called_silent(tmp_path, caplog):
    """Metric names leave the wrapper level off (``module.``), and the check for sections that
    yielded nothing rebuilt layer names from them: ``^model\\.module\\.fc1$`` matched none, and
    a section whose values were written was named as yielding none."""
    import torch

    import distmetrics as dm

    model = _wrapped(_model())
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"^model\.module\.fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"],
                                                          "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    with dm.Monitor(cfg, model=model) as monitor:
        model(torch.randn(3, 6)).sum().backward()
        monitor.step(1)
    [record] = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert "tensor_stats/fc1/activation/max" in record
    assert not [r.getMessage() for r in caplog.records if "no value came" in r.getMessage()]


def test_a_wrapper_and_the_module_it_wraps_selected_by_two_sections_are_refused(tmp_path):
    """Two sections, one selecting DDP's level (``^model$``: its activation and input max at every
    step), one the module it wraps (``^model\\.module$``: its activation min every other step): both
    are written under one name, and the wrapper's values were dropped at every step without a word.
    One section selecting both still counts the inner one once (the wrapper-level test above)."""
    import distmetrics as dm

    def section(pattern, tensors, stat):
        return {"enabled": True, "layers": {"layer_name_regex_pattern": pattern},
                "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": tensors, "stats": [stat]}}}

    features = {"outer": section(r"^model$", ["activation", "input"], "max"),
                "inner": section(r"^model\.module$", ["activation"], "min")}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    with pytest.raises(ValueError, match=r"sections 'outer' and 'inner' select 'model' and 'model.module', a wrapper "
                                         r"and the module it wraps"):
        dm.Monitor(cfg, model=_wrapped(_model()))


def test_a_tensor_name_holding_an_underscore_is_kept_whole(tmp_path):
    """nvdlfw-inspect's base LogTensorStats called from the user's code for a tensor the features
    file names ``attn_scores``: written as ``attn/attn/scores_max`` (split at the first ``_``)."""
    import nvdlfw_inspect.api as debug_api
    import torch

    import distmetrics as dm

    model = torch.nn.Sequential()
    model.add_module("attn", torch.nn.Linear(4, 4))
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "attn$"},
                      "LogTensorStats": {"enabled": True, "tensors": ["attn_scores"], "stats": ["max"], "freq": 1}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    scores = torch.arange(6.0).reshape(2, 3)
    with dm.Monitor(cfg, model=model) as monitor:
        debug_api.log_tensor_stats("model.attn", tensor=scores, tensor_name="attn_scores")
        monitor.step(1)
    [record] = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert {k: v for k, v in record.items() if k.startswith("tensor_stats/")} == \
        {"tensor_stats/attn/attn_scores/max": 5.0}


def test_a_complex_tensor_is_named_once_not_measured_by_its_real_part(tmp_path, caplog):
    """A spectral layer's output (torch.fft) was measured as its real part: an l2_norm of 10.73 where
    |z|'s is 12.40, said only by torch's own warning naming no layer."""
    import torch

    import distmetrics as dm

    class Spectral(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(5, dtype=torch.cfloat))

        def forward(self, x):
            return torch.fft.rfft(x) * self.w

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.spec, self.fc = Spectral(), torch.nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.spec(x).abs())

    model, outs = Net(), []
    model.fc.register_forward_hook(lambda module, args, out: outs.append(out.detach().double()))
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "spec|fc"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                         "stats": ["l2_norm"], "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    caplog.set_level("WARNING", logger="distmetrics")
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2):
            model(torch.randn(3, 8))
            monitor.step(step)
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert [sorted(k for k in r if k.startswith("tensor_stats/")) for r in records] == \
        [["tensor_stats/fc/activation/l2_norm"]] * 2
    assert records[-1]["tensor_stats/fc/activation/l2_norm"] == pytest.approx(float(outs[-1].norm()))
    said = [r.getMessage() for r in caplog.records if "complex" in r.getMessage()]
    assert len(said) == 1 and "tensor 'activation' on layer 'model.spec'" in said[0], said
    assert "torch.complex64" in said[0], said


def test_a_model_given_to_initialize_and_to_the_monitor_is_hooked_once(tmp_path):
    """Hooked twice, every activation would count twice and the std would come out wrong."""
    import torch

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                          "stats": ["std"], "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    model = _model()
    dm.inspect.initialize(cfg, model=model)
    x = torch.randn(5, 6)
    with dm.Monitor(cfg, model=model) as monitor:
        activation = model.fc1(x).detach()
        monitor.step(1)
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    assert record["tensor_stats/fc1/activation/std"] == pytest.approx(float(activation.double().std()), rel=1e-12)


def test_selectors_see_the_model_prefix_and_metric_names_leave_it_off(tmp_path):
    """nvdlfw-inspect names a plain model's layers ``model.<path>``: an exact name selects with
    that prefix, and the statistics are named without it (as the README and the shipped features
    file say); the bare path selects no layer, which is refused with the names to use. (Handed to
    nvdlfw-inspect 0.2.2 as they are, exact_layer_names raise its ValueError at the first layer
    they leave out: the root module.)"""
    import torch

    import distmetrics as dm

    def config(names, out):
        features = {"s": {"enabled": True, "layers": {"exact_layer_names": names},
                          "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                              "stats": ["max"], "freq": 1}}}}
        return dm.MetricsConfig(output_dir=str(out), log_interval=1, console=False, tensorboard=False,
                                timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})

    model = _model()
    x = torch.randn(5, 6)
    with dm.Monitor(config(["model.fc1"], tmp_path / "prefixed"), model=model) as monitor:
        activation = model.fc1(x).detach()
        monitor.step(1)
    record = [r for r in dm.read_jsonl(tmp_path / "prefixed" / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    assert [k for k in record if k.startswith("tensor_stats/")] == ["tensor_stats/fc1/activation/max"]
    assert record["tensor_stats/fc1/activation/max"] == pytest.approx(float(activation.double().max()), rel=1e-12)
    with pytest.raises(ValueError, match=r"select no layer of the model on any rank.*'model\.fc1'"):
        with dm.Monitor(config(["fc1"], tmp_path / "bare"), model=_model()) as monitor:
            _model()(x)
            monitor.step(1)


def _activation_stats_run(tmp_path, name: str, train_step, gradient: bool = False) -> dict:
    """Two steps of ``train_step(model, step)`` with fc1's activation statistics every step (and
    its output's gradient's: ``train_step`` returns both truths then); the tensor_stats records by step."""
    import distmetrics as dm

    tensors = ["activation", "gradient"] if gradient else ["activation"]
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": tensors,
                                                          "stats": ["max", "mean", "l1_norm", "l2_norm"], "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path / name), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    model = _model()
    with dm.Monitor(cfg, model=model) as monitor:
        truth = {}
        for step in (1, 2):
            truth[step] = train_step(model, monitor, step)
            monitor.step(step)
    records = {r["step"]: r for r in dm.read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    for step, tensors_truth in truth.items():
        for tensor, x in zip(tensors, tensors_truth if gradient else (tensors_truth,)):
            for stat, value in (("max", x.max()), ("mean", x.mean()), ("l1_norm", x.abs().sum()),
                                ("l2_norm", x.norm())):
                logged = records[step].get(f"tensor_stats/fc1/{tensor}/{stat}")
                assert logged == pytest.approx(float(value), rel=1e-6), (name, step, tensor, stat)
    return records


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_recomputation_is_not_counted_twice(tmp_path, reentrant):
    """Activation checkpointing (Megatron's recompute) runs the layer's forward again inside
    backward: the hook counted the activations twice (l1_norm 2x, l2_norm sqrt(2)x). Reentrant
    checkpointing runs the first forward under no_grad: its output's gradient was never hooked
    (no gradient statistics, without a word); the recomputation's, which backward reaches, is."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def train_step(model, monitor, step):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).requires_grad_()  # reentrant: recomputes
        hidden = checkpoint(lambda inputs: torch.tanh(model.fc1(inputs)), x, use_reentrant=reentrant)
        model.fc2(hidden).sum().backward()
        w1, b1, w2 = (t.detach().double() for t in (model.fc1.weight, model.fc1.bias, model.fc2.weight))
        activation = torch.nn.functional.linear(x.detach().double(), w1, b1).requires_grad_()
        (torch.tanh(activation) @ w2.T).sum().backward()  # fc2's bias adds no gradient
        return activation.detach().reshape(-1), activation.grad.reshape(-1)

    _activation_stats_run(tmp_path, "recompute", train_step, gradient=True)


@pytest.mark.parametrize("how", ["paused", "eval mode"])
def test_an_evaluation_forward_is_not_counted_in_the_next_steps_statistics(tmp_path, how):
    """An evaluation after step 1 (between monitor.pause() and resume(), or with the model in
    eval mode) entered step 2's training statistics (l2_norm 154 for 3)."""
    import torch

    def train_step(model, monitor, step):
        if step == 2:  # the evaluation after step 1, on a big batch
            if how == "paused":
                monitor.pause()
            else:
                model.eval()
            with torch.no_grad():
                model(10 * torch.randn(100, 6))
            monitor.resume()
            model.train()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        return torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias).detach().double().reshape(-1)

    _activation_stats_run(tmp_path, how.replace(" ", "_"), train_step)


def test_a_pause_never_resumed_ends_at_the_log_step_for_the_statistics_too(tmp_path, caplog):
    """monitor.pause() after step 1, never resumed: the clocks' pause ended at the next log step, the
    tensor statistics' hooks stayed paused for the rest of the run (no record, and a warning blaming
    the layers)."""
    import logging

    import torch

    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    features = _section({"layer_name_regex_pattern": "fc1$"}, {"stats": ["l2_norm"], "freq": 1})
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    model = _model()
    truth = {}
    with dm.Monitor(cfg, model=model) as monitor:
        for step in range(1, 7):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            truth[step] = float(torch.nn.functional.linear(x.double(), model.fc1.weight.double(),
                                                           model.fc1.bias.double()).norm())
            monitor.step(step)
            if step == 1:
                monitor.pause()  # never resumed
    records = {r["step"]: r["tensor_stats/fc1/activation/l2_norm"]
               for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    assert records == {step: pytest.approx(truth[step], rel=1e-6) for step in (1, 3, 4, 5, 6)}
    said = [r.getMessage() for r in caplog.records if "no value came" in r.getMessage()]
    assert len(said) == 1 and "selects step 2" in said[0] and "monitor.pause() was open" in said[0], said


def _sharded_weights(rank: int, world: int, root: str) -> dict:
    """FSDP2 with fc1 its own unit: its forward hook sees the weight resharded (a Shard(0) DTensor)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["weight"],
                                                          "stats": ["min", "max", "std", "l2_norm"], "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    model = _model()
    fully_shard(model.fc1)
    fully_shard(model)
    with dm.Monitor(cfg, model=model) as monitor:
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).sum().backward()
        weight = model.fc1.weight.full_tensor().detach().double().reshape(-1)
        monitor.step(1)
    records = [r for r in dm.read_jsonl(f"{root}/metrics.jsonl") if r["kind"] == "tensor_stats"] if rank == 0 else []
    return {"truth": {"min": float(weight.min()), "max": float(weight.max()), "std": float(weight.std()),
                      "l2_norm": float(weight.norm())},
            "got": records[0] if records else None}


def test_statistics_of_a_sharded_weight_are_those_of_the_whole_weight(tmp_path):
    """A weight sharded over ranks (FSDP2 unit resharded after forward; Megatron's TP shards) was
    counted on the first replica only: its statistics were one shard's (l2_norm 1.61 for 2.33).
    Each rank's shard counts, as for the norms."""
    result = run_ranks(_sharded_weights, 2, str(tmp_path), timeout=120)[0]
    for stat, value in result["truth"].items():
        got = result["got"].get(f"tensor_stats/fc1/weight/{stat}")
        assert got == pytest.approx(value, rel=1e-6), (stat, got, value)


def test_the_layer_numbers_selector_selects_numbered_layers(tmp_path):
    """nvdlfw-inspect reads a layer's number from its name and raised IndexError on the root module
    (``model``: no number), so a section with layer_numbers made Monitor() fail with no key named;
    a name with two numbers (an expert's) must still be selectable by another section."""
    import torch
    from torch import nn

    import distmetrics as dm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 4)
            self.experts = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # names with two numbers

        def forward(self, x):
            return self.experts(self.fc1(x))

    model = nn.Sequential(Block(), Block())
    stats = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"], "freq": 1}}
    features = {"s": {"enabled": True, "layers": {"layer_numbers": [1], "layer_types": ["fc1"]}, "distmetrics": stats},
                "experts": {"enabled": True, "layers": {"layer_name_regex_pattern": r"experts\.\d+$"},
                            "distmetrics": stats}}  # selects names the layer_numbers section cannot read
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    x = torch.randn(3, 4)
    with dm.Monitor(cfg, model=model) as monitor:
        model(x)
        monitor.step(1)
    first = model[0](x)
    truth = {"1.fc1": model[1].fc1(first), "0.experts.1": first, "1.experts.1": model(x),
             "0.experts.0": model[0].experts[0](model[0].fc1(x)), "1.experts.0": model[1].experts[0](model[1].fc1(first))}
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"][0]
    assert sorted(k for k in record if k.startswith("tensor_stats/")) == sorted(
        f"tensor_stats/{layer}/activation/max" for layer in truth)
    for layer, activation in truth.items():
        got = record[f"tensor_stats/{layer}/activation/max"]
        assert got == pytest.approx(float(activation.detach().double().max()), rel=1e-6), layer


# --- nvdlfw-inspect's own base feature, silent sections, one inspector per process -----------------

def _base_and_silent(tmp_path):
    return {"base": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                     "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean", "max"]}},
            "silent": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc2$"},
                       "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                                 "stats": ["max"]}}}}


def test_nvdlfw_base_log_tensor_stats_on_plain_modules_runs_through_our_hooks(tmp_path, caplog):
    """As nvdlfw-inspect's documentation writes it (bare LogTensorStats): our hooks call it; and a
    section nothing feeds (TE's namespace on plain modules) is named once."""
    import logging

    import torch

    import distmetrics as dm
    from tests.te_cpu import FEATURES_DIR

    caplog.set_level(logging.WARNING, logger="distmetrics")
    ti = {"enabled": True, "features": _base_and_silent(tmp_path), "feature_dirs": [FEATURES_DIR],
          "allow_custom_feature_dirs": True}
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, log_progress=False,
                                          tensorboard=False, tensor_inspect=ti), model=_model())
    activations = []
    monitor.model.fc1.register_forward_hook(lambda m, i, o: activations.append(o.detach().double()))
    for step in (1, 2, 3):
        monitor.model(torch.randn(4, 6)).sum().backward()
        monitor.step(step)
    monitor.close()
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record, activation in zip(records, activations):
        assert record["tensor_stats/fc1/activation/mean"] == pytest.approx(float(activation.mean()), rel=1e-6)
        assert record["tensor_stats/fc1/activation/max"] == pytest.approx(float(activation.max()), rel=1e-6)
    named = [r.getMessage() for r in caplog.records if "no value came from any of its layers" in r.getMessage()]
    assert len(named) == 1 and "section 'silent'" in named[0]


def test_a_second_monitor_with_tensor_inspection_is_refused_until_the_first_closes(tmp_path):
    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}}}}
    first = _monitor_with(features, tmp_path / "a")
    with pytest.raises(dm.ConfigError, match="another Monitor in this process runs tensor inspection already"):
        _monitor_with(features, tmp_path / "b")
    first.close()
    _monitor_with(features, tmp_path / "b").close()


def test_feature_code_in_the_working_directory_is_never_imported(tmp_path):
    """A transformer_engine folder that is only on the path (TE not installed) is not TE: its
    feature code must not run, and the config is refused."""
    features_dir = tmp_path / "transformer_engine" / "debug" / "features"
    features_dir.mkdir(parents=True)
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    (features_dir / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    (tmp_path / "features.yaml").write_text(textwrap.dedent("""\
        s:
          enabled: true
          layers: {layer_name_regex_pattern: "fc1$"}
          transformer_engine:
            LogFp8TensorStats: {enabled: true, tensors: [activation], stats: [underflows%]}
        """))
    code = textwrap.dedent("""\
        import torch, distmetrics as dm
        model = torch.nn.Sequential(); model.add_module("fc1", torch.nn.Linear(2, 2))
        try:
            dm.Monitor(dm.MetricsConfig(output_dir="run", tensor_inspect={"enabled": True,
                       "features": "features.yaml"}), model=model)
        except dm.ConfigError as err:
            print("refused:", err)
        """)
    run = run_python("-c", code, cwd=tmp_path)
    assert "refused:" in run.stdout and "needs TransformerEngine" in run.stdout, run.stderr[-2000:]
    cli = run_python("-m", "distmetrics.cli", "check-features", "features.yaml", cwd=tmp_path)
    assert cli.returncode == 2
    assert not (tmp_path / "ran").exists()


def test_partials_of_every_rank_merge_in_one_pass_to_those_of_the_whole_tensor():
    import torch

    from distmetrics.tensor_stats.statistics import PARTS, merge_ranks, partials

    generator = torch.Generator().manual_seed(7)
    chunks = [torch.randn(size, generator=generator, dtype=torch.float64) * scale + shift
              for size, scale, shift in ((5, 1.0, 0.0), (1, 3.0, 2.0), (300, 0.1, -4.0), (40, 10.0, 1e3))]
    chunks[1][0] = 0.0  # a zero: not the smallest non-zero magnitude
    columns = [[float(partials(c)[p]) for p in PARTS] for c in chunks]
    columns.insert(2, [math.nan] * len(PARTS))  # a rank that sent nothing for this key
    table = torch.tensor(columns, dtype=torch.float64).T.unsqueeze(0)  # [key, part, rank]
    merged = {p: float(v[0]) for p, v in merge_ranks(table).items()}
    whole = torch.cat(chunks)
    assert merged["n"] == whole.numel()
    assert merged["mean"] == pytest.approx(float(whole.mean()), rel=1e-12)
    assert merged["m2"] / (merged["n"] - 1) == pytest.approx(float(whole.var()), rel=1e-12)
    assert (merged["min"], merged["max"]) == (float(whole.min()), float(whole.max()))
    assert merged["l1"] == pytest.approx(float(whole.abs().sum()), rel=1e-12)
    assert merged["sumsq"] == pytest.approx(float(whole.pow(2).sum()), rel=1e-12)
    assert merged["minabs"] == float(whole.abs()[whole != 0].min())


# --- exact_layer_names -----------------------------------------------------------------------
# exact_layer_names in a features file: a single string is one layer name (the anchored pattern
# selects that layer alone); any other value that is not a non-empty list of names is refused
# before training, naming the file, the section, the key, the value and what is accepted.

_SECTION = """\
fc1_stats:
  enabled: true
  layers:
    exact_layer_names: {value}
  distmetrics:
    LogTensorStats: {{enabled: true, tensors: [activation], stats: [max], freq: 1}}
"""


def _load(tmp_path, value: str):
    from distmetrics.tensor_stats.features import load_features

    path = tmp_path / "features.yaml"
    path.write_text(_SECTION.format(value=value))
    return path, load_features(str(path))


def test_a_string_is_one_exact_layer_name(tmp_path):
    _, spec = _load(tmp_path, "model.layers.1.fc")
    pattern = spec["fc1_stats"]["layers"]["layer_name_regex_pattern"]
    assert spec == _load(tmp_path, "[model.layers.1.fc]")[1]  # as the one-name list
    # nvdlfw-inspect looks layers up with re.search: the name alone, not its prefixes or extensions
    selected = [n for n in ("model.layers.1.fc", "model.layers.1.fc2", "model.layers.11.fc", "xmodel.layers.1.fc",
                            "model.layers.1", "model.layersX1.fc") if re.search(pattern, n)]
    assert selected == ["model.layers.1.fc"]


@pytest.mark.parametrize("text, value", [("5", 5), ("[]", []), ("[model.fc1, 3]", ["model.fc1", 3]),
                                         ("{model.fc1: true}", {"model.fc1": True}), ("[model.fc1, '']", ["model.fc1", ""]),
                                         ("''", "")])
def test_an_invalid_value_names_key_value_and_what_is_accepted(tmp_path, text, value):
    from distmetrics.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    message = str(err.value)
    assert f"{tmp_path / 'features.yaml'}: section 'fc1_stats'" in message
    assert "exact_layer_names must be a list of layer names such as [model." in message
    assert f"got {value!r}" in message  # as written ('' was quoted as [''])


def test_one_section_with_both_log_tensor_stats_features_is_refused():
    """Both are measured by the Monitor's hooks into one (layer, tensor): l1_norm 63.70 for 31.85."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    feature = {"enabled": True, "tensors": ["activation"], "stats": ["l1_norm"]}
    with pytest.raises(ConfigError, match="section 's': both nvdlfw-inspect's LogTensorStats and "
                                          "distmetrics.LogTensorStats"):
        load_features({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                             "LogTensorStats": feature, "distmetrics": {"LogTensorStats": feature}}})


def test_a_selector_without_a_value_is_named(tmp_path):
    """`exact_layer_names:` with nothing after it passed our check, and nvdlfw-inspect then said
    that no selector was given, naming neither file nor section."""
    from distmetrics.config import ConfigError

    with pytest.raises(ConfigError, match=r"section 'fc1_stats': layers.exact_layer_names has no value"):
        _load(tmp_path, "")


def _base_feature_through_hooks(rank: int, world: int, out: str) -> dict:
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(6, 12))
    model.add_module("fc2", torch.nn.Linear(6, 3))
    features = {"base_stats": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                               "LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                  "stats": ["MIN", "max", "mean", "std", "l1_norm", "l2_norm"]}}}
    cfg = dm.MetricsConfig(output_dir=out, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           hang_timeout_s=20, tensor_inspect={"enabled": True, "features": features,
                                                              "log_dir": f"{out}/inspect{rank}"})
    seen: dict = {}
    model.fc1.register_forward_hook(lambda m, i, o: seen.setdefault(step, []).append(o.detach().double().reshape(-1)))
    with dm.Monitor(cfg, model=model) as monitor:
        for step in (1, 2, 3):
            for micro in range(2):
                x = torch.randn(2 + 2 * rank, 6, generator=torch.Generator().manual_seed(10 * step + micro + rank))
                if step == 2 and rank == 1:  # a branch (an expert) that gets no token on this rank this step
                    model.fc2(x).sum().backward()
                else:
                    model.fc1(x).sum().backward()
            monitor.step(step)
    parts = [None] * world
    dist.all_gather_object(parts, {s: torch.cat(v).tolist() for s, v in seen.items()})  # the truth, after the run
    return parts


def test_nvdlfw_base_log_tensor_stats_through_the_hooks_is_exact_across_ranks(tmp_path):
    """nvdlfw-inspect's own LogTensorStats, called from our hooks, gathered each tensor along its
    first dimension inside the hook: rank batches of 2 and 4 rows gave statistics of zero-padded
    tensors (mean 0.07 for 0.10), a layer run on rank 0 only left it waiting in the hook, and the
    last micro-batch's value replaced the first's. Measured as ours, every statistic equals the
    float64 statistic of every rank's activations of the step, both micro-batches."""
    import torch

    import distmetrics as dm

    parts = run_ranks(_base_feature_through_hooks, 2, str(tmp_path), timeout=150)[0]
    stats = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"}
    assert sorted(stats) == [1, 2, 3]
    for step, record in stats.items():
        full = torch.tensor([v for rank in parts for v in rank.get(step, [])], dtype=torch.float64)
        truth = {"min": full.min(), "max": full.max(), "mean": full.mean(), "std": full.std(),
                 "l1_norm": full.abs().sum(), "l2_norm": full.norm()}
        for stat, value in truth.items():
            assert record[f"tensor_stats/fc1/activation/{stat}"] == pytest.approx(float(value), rel=1e-9), (step, stat)


def _features_missing_on(rank: int, world: int, root: str, missing: str, factory: bool) -> tuple:
    import distmetrics as dm

    features = Path(root) / "features.yaml"
    if rank == 0:
        features.write_text(FEATURES)
    import torch.distributed as dist

    dist.barrier()  # rank 0 wrote its file; a rank named in `missing` reads a path its host does not have
    path = str(Path(root) / "elsewhere" / "features.yaml") if str(rank) in missing else str(features)
    cfg = dm.MetricsConfig(output_dir=f"{root}/out", tensorboard=False, console=False, hang_timeout_s=20,
                           tensor_inspect={"enabled": True, "features": path})
    try:
        dm.Monitor(cfg, model=_model if factory else _model())
        return "no error", None
    except ValueError as err:
        return str(err), type(err).__name__


@pytest.mark.parametrize("factory", [False, True], ids=["a model", "a model factory"])
@pytest.mark.parametrize("missing", ["1", "01"], ids=["on rank 1", "on every rank"])
def test_a_features_file_a_rank_cannot_read_is_raised_on_every_rank(tmp_path, missing, factory):
    """The features file was checked after the start-up gather (with a model factory, when the
    inspector started): the rank that could not read it raised, and the other waited in the next
    collective (no message until hang_timeout_s). It is checked before, the gather says it on
    every rank, once for the ranks that share it, as a ConfigError where every rank's problem is
    a config error."""
    for message, kind in run_ranks(_features_missing_on, 2, str(tmp_path), missing, factory, timeout=120):
        ranks = "rank 1: " if missing == "1" else "ranks 0, 1: "
        assert ranks in message and "elsewhere/features.yaml' does not exist" in message, message
        assert message.count("does not exist") == 1 and kind == "ConfigError", (message, kind)


def _initialize_with_features_missing_on(rank: int, world: int, root: str, case: str) -> tuple:
    """The README's TransformerEngine order on each rank: ``initialize``, the model, ``Monitor``. ``case``:
    the features file missing on rank 1 ("missing"; "missing, model": ``initialize`` given the model),
    rank 1 leaving ``initialize(..., model=)`` out ("skipped"), or ``enabled: false`` on every rank ("disabled";
    "disabled, model")."""
    import time

    import torch.distributed as dist

    import distmetrics as dm

    features = Path(root) / "features.yaml"
    if rank == 0:
        features.write_text(FEATURES)
    dist.barrier()  # rank 0 wrote its file; rank 1 reads a path its host does not have
    missing = case.startswith("missing") and rank == 1  # a path rank 1's host does not have
    path = str(Path(root) / "elsewhere" / "features.yaml") if missing else str(features)
    cfg = dm.MetricsConfig(output_dir=f"{root}/out{rank}", tensorboard=False, console=False, hang_timeout_s=20,
                           tensor_inspect={"enabled": not case.startswith("disabled"), "features": path})
    started = time.monotonic()
    try:
        model = _model()
        if case.startswith(("missing", "disabled")) or rank == 0:
            dm.tensor_stats.initialize(cfg, model=model if case.endswith("model") or case == "skipped" else None)
        dm.Monitor(cfg, model=model).close()
        return "no error", "", time.monotonic() - started
    except Exception as err:  # noqa: BLE001 - what each rank raised is the test's subject
        return type(err).__name__, str(err), time.monotonic() - started


def _start_with_a_fault_on_rank_1(rank: int, world: int, root: str, fault: str, call: str = "Monitor") -> tuple:
    """``Monitor()`` (or ``tensor_stats.initialize(model=)``) with inspection on, rank 1 given ``fault``:
    "reader" (an error of another kind than ConfigError: the file's reader failing on this rank alone),
    "no nvdlfw" (the package missing, as on a host without it: its import raises) or "broken nvdlfw" (the
    package found, a module the start imports after the start-up gather not importable)."""
    import sys
    import time

    import distmetrics as dm
    from distmetrics.tensor_stats import lifecycle

    if rank == 1 and fault == "reader":
        def broken(config):
            raise RuntimeError("the reader broke")
        lifecycle.check_inspect_config = broken
    if rank == 1 and fault in ("no nvdlfw", "broken nvdlfw"):
        sys.modules["nvdlfw_inspect" if fault == "no nvdlfw" else "nvdlfw_inspect.config_manager"] = None
    features = Path(root) / f"features{rank}.yaml"
    features.parent.mkdir(parents=True, exist_ok=True)
    features.write_text(FEATURES)
    cfg = dm.MetricsConfig(output_dir=f"{root}/out{rank}", tensorboard=False, console=False, hang_timeout_s=60,
                           tensor_inspect={"enabled": True, "features": str(features)})
    started = time.monotonic()
    try:
        if call == "initialize":
            dm.tensor_stats.initialize(cfg, model=_model())
        else:
            dm.Monitor(cfg, model=_model()).close()
        return "no error", "", 0.0
    except Exception as err:  # noqa: BLE001 - what each rank raised is the test's subject
        return type(err).__name__, str(err), time.monotonic() - started


def test_any_error_reading_the_features_on_one_rank_is_raised_on_every_rank_at_once(tmp_path):
    """Only a ConfigError was shared at start-up: another error on one rank (a TypeError from a tensor
    name nvdlfw-inspect could not hash) raised there alone while the others waited hang_timeout_s
    and named the wrong cause. The failure is stood in for by replacing the features check on rank 1."""
    for kind, message, waited in run_ranks(_start_with_a_fault_on_rank_1, 2, str(tmp_path), "reader", timeout=120):
        assert kind == "ConfigError" and waited < 30, (kind, message, waited)
        assert message.startswith("distmetrics cannot start: rank 1: tensor_inspect: RuntimeError: the reader broke")


def test_tensor_inspection_without_nvdlfw_inspect_names_the_package_and_its_extra_on_every_rank(tmp_path):
    """Without nvdlfw-inspect, or with one whose module the start imports cannot be imported, turning
    inspection on raised a bare ModuleNotFoundError from deep inside the inspector's start, naming neither
    the pip package nor the extra, on that rank alone (the other saw gloo's connection closed). It is now
    a ConfigError checked with the features file, before any collective: every rank raises it at once."""
    said = {"no nvdlfw": "rank 1: tensor_inspect.enabled is true but nvdlfw-inspect is not installed: pip install "
                         'nvdlfw-inspect==0.2.2 (the "inspect" extra), or set tensor_inspect.enabled: false',
            "broken nvdlfw": "rank 1: tensor_inspect.enabled is true but nvdlfw-inspect cannot be imported "
                             "(nvdlfw_inspect.base: ModuleNotFoundError: import of "
                             "nvdlfw_inspect.config_manager halted; None in sys.modules): pip install "
                             'nvdlfw-inspect==0.2.2 (the "inspect" extra) again, or set tensor_inspect.enabled: false'}
    for fault, call in (("no nvdlfw", "Monitor"), ("no nvdlfw", "initialize"), ("broken nvdlfw", "Monitor"),
                        ("broken nvdlfw", "initialize")):
        ranks = run_ranks(_start_with_a_fault_on_rank_1, 2, str(tmp_path / fault / call), fault, call, timeout=120)
        for kind, message, waited in ranks:
            assert (kind, message) == ("ConfigError", f"distmetrics cannot start: {said[fault]}"), call
            assert waited < 30, (call, waited)


def test_initialize_says_a_features_file_one_rank_cannot_read_on_every_rank(tmp_path):
    """``initialize`` checked the features file on its own rank: rank 1 raised, rank 0 went on into
    ``Monitor()`` and waited there hang_timeout_s (20 s) for a rank that never came. Given the model
    (hooking it is a collective already) the check is gathered, as ``Monitor()``'s is, and every rank
    raises it before nvdlfw-inspect starts anywhere; without, rank 1 raises it and is named at once,
    with it, at the others' ``Monitor()``."""
    for kind, message, _ in run_ranks(_initialize_with_features_missing_on, 2, str(tmp_path), "missing, model",
                                      timeout=120):
        assert kind == "ConfigError", (kind, message)
        assert message.startswith("distmetrics cannot start: rank 1: tensor_inspect.features: file '") and \
            "elsewhere/features.yaml' does not exist" in message, message
    (kind, message, waited), (own, said, _) = run_ranks(_initialize_with_features_missing_on, 2, str(tmp_path),
                                                        "missing", timeout=120)
    assert own == "ConfigError" and "elsewhere/features.yaml' does not exist" in said, (own, said)
    assert kind == "HangError" and waited < 15, (kind, message, waited)
    assert "rank 1: last call raised ConfigError in tensor_stats.initialize: tensor_inspect.features: file '" \
        in message and "does not exist" in message, message


def test_initialize_with_tensor_inspect_disabled_says_there_is_nothing_to_initialise(tmp_path):
    """The shipped ``configs/metrics.yaml`` has ``enabled: false``: ``initialize`` refuses it, with the README's
    words, on each rank alone without ``model=`` and after the every-rank prefix with it."""
    import distmetrics as dm
    from distmetrics.config import ConfigError

    said = "tensor_inspect.enabled is false: nothing to initialise"
    for case, prefix in (("disabled", ""), ("disabled, model", "distmetrics cannot start: ranks 0, 1: ")):
        for kind, message, _ in run_ranks(_initialize_with_features_missing_on, 2, str(tmp_path), case, timeout=120):
            assert (kind, message) == ("ConfigError", prefix + said), case
    with pytest.raises(ConfigError, match=f"^{said}$"):  # without a process group
        shipped = Path(__file__).parents[1] / "configs" / "metrics.yaml"
        dm.tensor_stats.initialize(dm.MetricsConfig.from_yaml(str(shipped)))


def test_a_rank_that_leaves_initialize_out_is_named_at_once_rather_than_waited_for(tmp_path):
    """Rank 0's every-rank check meets rank 1's ``Monitor()`` start-up: the arrival check tells the calls
    apart and both ranks raise at once, naming them, well within hang_timeout_s (20 s)."""
    for kind, message, waited in run_ranks(_initialize_with_features_missing_on, 2, str(tmp_path), "skipped",
                                           timeout=120):
        assert kind == "HangError" and "tensor_stats.initialize() on rank 0" in message and \
            "Monitor() on rank 1" in message, (kind, message)
        assert waited < 15, waited


@pytest.mark.parametrize("freqs,steps", [((1, 2), (1, 2, 3)), ((2, 1), (1, 3))], ids=["first every step",
                                                                             "first every second step"])
def test_nvdlfw_base_log_tensor_stats_takes_a_tensors_first_entry_as_nvdlfw_does(tmp_path, caplog, freqs, steps):
    """Two tensors_struct entries for one tensor: nvdlfw-inspect's own feature uses the first
    (max); through our hooks the last one won (min at steps 1 and 3). And the second one's
    schedule alone (every step) still made a statistics step: a gather at the steps between,
    which brought nothing, and a warning that the section yielded no value."""
    import torch

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1$"},
                      "LogTensorStats": {"enabled": True, "tensors_struct": [
                          {"tensor": "activation", "stats": ["max"], "freq": freqs[0]},
                          {"tensor": "activation", "stats": ["min"], "freq": freqs[1]}]}}}
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, log_progress=False,
                                          tensorboard=False, tensor_inspect={"enabled": True, "features": features}),
                         model=_model())
    for step in (1, 2, 3):  # iterations 0, 1, 2
        monitor.model(torch.randn(4, 6)).sum().backward()
        monitor.step(step)
    monitor.close()
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    assert [(r["step"], sorted(k for k in r if k.startswith("tensor_stats/"))) for r in records] == \
        [(s, ["tensor_stats/fc1/activation/max"]) for s in steps]
    assert not [r.getMessage() for r in caplog.records if "no value came" in r.getMessage()]


def test_the_dynamic_range_of_a_tensor_holding_nan_is_nan():
    """amax > 0 is False for NaN: the dynamic range read 0.0, a healthy-looking value."""
    import torch

    from distmetrics.tensor_stats.statistics import partials, stat_value

    values = {part: float(v) for part, v in partials(torch.tensor([1.0, math.nan, 4.0], dtype=torch.float64)).items()}
    assert math.isnan(stat_value("dynamic_range", values))
    finite = {part: float(v) for part, v in partials(torch.tensor([1.0, -4.0], dtype=torch.float64)).items()}
    assert stat_value("dynamic_range", finite) == 2.0


def _te_dynamic_range(values: list) -> float:
    """TransformerEngine's ``dynamic_range`` of one tensor (``debug/features/utils/stats_computation.py``):
    log2 of the largest non-zero |x|, inf where there is none, less log2 of the smallest, of 1 where
    there is none."""
    import torch

    magnitude = torch.tensor(values, dtype=torch.float64).abs()
    nonzero = magnitude[magnitude != 0]
    top = torch.log2(nonzero.max()) if nonzero.numel() else torch.tensor(math.inf, dtype=torch.float64)
    bottom = torch.log2(nonzero.min()) if nonzero.numel() else torch.tensor(0.0, dtype=torch.float64)
    return float(top - bottom)


_EDGE_VALUES = {  # step -> the layer's output on rank 0, on rank 1
    1: ([math.inf, math.inf], [-math.inf, -math.inf]),  # every value ±inf: log2(inf) - log2(inf)
    2: ([0.0, 0.0, 0.0], [0.0, 0.0]),  # every value zero: no non-zero value
    3: ([0.0, 0.0], [0.5, -8.0]),  # zeros on one rank: the union's range
}


def _dynamic_range_edges(rank: int, world: int, root: str) -> dict:
    import torch
    from torch import nn

    import distmetrics as dm

    class Given(nn.Module):
        step = 1

        def forward(self, x):
            return torch.tensor(_EDGE_VALUES[self.step][rank]) + 0 * x.sum()

    model = nn.Sequential()
    model.add_module("given", Given())
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "given$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                         "stats": ["dynamic_range"], "freq": 1}}}}
    cfg = dm.MetricsConfig(output_dir=f"{root}/out", log_interval=100, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    with dm.Monitor(cfg, model=model) as monitor:
        for step in _EDGE_VALUES:
            model.given.step = step
            with torch.no_grad():
                model(torch.ones(1))
            monitor.step(step)
    if rank != 0:
        return {}
    return {r["step"]: r["tensor_stats/given/activation/dynamic_range"]
            for r in dm.read_jsonl(Path(root) / "out" / "metrics.jsonl") if r["kind"] == "tensor_stats"}


def test_the_dynamic_range_of_all_inf_and_all_zero_tensors_is_transformer_engines(tmp_path):
    """Every value ±inf read 0.0 (log2(inf) - log2(inf) is undefined: TE gives NaN), and an all-zero
    tensor 0.0 (TE gives inf, its log2 of no non-zero amax); a rank holding only zeros leaves the
    range of the union, the other rank's."""
    got = run_ranks(_dynamic_range_edges, 2, str(tmp_path), timeout=120)[0]
    for step, (first, second) in _EDGE_VALUES.items():
        truth = _te_dynamic_range(first + second)
        assert (math.isnan(got[step]) and math.isnan(truth)) or got[step] == truth, (step, got[step], truth)
    assert math.isnan(got[1]) and got[2] == math.inf and got[3] == 4.0


@pytest.mark.parametrize("text", [FEATURES, "s:\n  enabled: true\n"], ids=["a long file's text", "two lines"])
def test_features_given_as_yaml_text_are_named_as_text_not_as_a_missing_file(tmp_path, text):
    """A string is a path: YAML text given as one was said as a file that does not exist (a long one
    raised a bare OSError, File name too long). The error says what inline features are."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), tensor_inspect={"enabled": True, "features": text})
    with pytest.raises(dm.ConfigError, match=re.escape("looks like YAML text")) as info:
        dm.tensor_stats.initialize(cfg)
    assert "inline features are a mapping" in str(info.value) and "\n" not in str(info.value), info.value
    for path in (r"C:\runs\features.yaml", f"{tmp_path}/job:7/features.yaml"):  # paths with a colon stay paths
        with pytest.raises(dm.ConfigError, match="does not exist"):
            dm.tensor_stats.initialize(cfg.replace(tensor_inspect={"enabled": True, "features": path}))


@pytest.mark.parametrize("namespace", ["distmetrics", "LogTensorStats"])
def test_start_end_list_selects_the_steps_nvdlfw_inspect_selects_an_open_end_included(tmp_path, namespace):
    """nvdlfw-inspect reads a ``start_end_list`` pair as start <= iteration < end, with -1 as no
    end; the open end was refused, and an empty pair ([3, 3]) passed and selected nothing."""
    import torch
    from nvdlfw_inspect.logging import enable_logging_at_current_step
    from torch import nn

    import distmetrics as dm

    pairs = [[1, 3], [5, -1]]
    stats = {"enabled": True, "tensors_struct": [{"tensor": "activation", "stats": ["max"], "start_end_list": pairs,
                                                  "freq": 2 if namespace == "LogTensorStats" else 1}]}
    body = {"distmetrics": {"LogTensorStats": stats}} if namespace == "distmetrics" else {"LogTensorStats": stats}
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"model\.0$"}, **body}}
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
    model = nn.Sequential(nn.Linear(3, 3))
    with dm.Monitor(cfg, model=model) as monitor:
        for step in range(1, 11):  # iteration = step - 1
            model(torch.randn(2, 3))
            monitor.step(step)
    got = [r["step"] - 1 for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "tensor_stats"]
    freq = stats["tensors_struct"][0]["freq"]
    assert got == [i for i in range(10) if enable_logging_at_current_step(i, freq, 0, -1, pairs)]
    assert got[-1] >= 8  # the open end: past every finite one

    stats["tensors_struct"][0]["start_end_list"] = [[3, 3]]
    with pytest.raises(ValueError, match=r"start_end_list for tensor 'activation' must be a list of \[start, end\] "
                                         r"step pairs, each selecting start <= step < end"):
        dm.Monitor(cfg.replace(output_dir=str(tmp_path / "empty")), model=model)


def _tp_and_cp_activations(rank: int, world: int, root: str) -> dict:
    """2 data-parallel x 2 tensor-parallel ranks: fc1 column-parallel (each TP rank holds half of its
    output, and of fc2's input and of fc1's output gradient), fc2 row-parallel (an all-reduced output:
    a copy on each TP rank); then 2 data-parallel x 2 context-parallel ranks, each a different half of
    every sequence. The truth: the float64 tensors of an unsharded copy on every rank's whole input."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import distmetrics as dm

    stats = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"model\.fc[12]$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True,
                                                          "tensors": ["activation", "input", "gradient"],
                                                          "stats": stats, "freq": 1}}}}
    results = {}
    for case in ("tp", "tp without device_mesh", "cp"):
        parallel = case.split()[0]
        torch.manual_seed(0)  # the same weights on every rank
        model = nn.Sequential()
        model.add_module("fc1", nn.Linear(6, 8))
        model.add_module("fc2", nn.Linear(8, 5))
        reference = {name: p.detach().double().clone() for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", parallel))
        dp, peer = mesh.get_local_rank("dp"), mesh.get_local_rank(parallel)
        x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(dp))  # one data-parallel batch
        if parallel == "tp":
            parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        else:
            x = x.chunk(2, dim=1)[peer].contiguous()  # this rank's half of every sequence
        out = f"{root}/{len(results)}"
        cfg = dm.MetricsConfig(output_dir=out, log_interval=1, console=False, tensorboard=False,
                               timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
        with dm.Monitor(cfg, model=model, device_mesh=None if "without" in case else mesh) as monitor:
            model(x).pow(2).sum().backward()
            monitor.step(1, tokens=x.shape[0] * 4)  # the data-parallel batch's tokens, counted once per replica
        # the truth: every data-parallel batch (every chunk) through the unsharded float64 copy
        xs = [None] * world
        torch.distributed.all_gather_object(xs, x)
        if parallel == "tp":
            whole = torch.cat([xs[r].reshape(-1, 6) for r in (0, 2)]).double()  # TP peers hold the same batch
        else:
            whole = torch.cat([t.reshape(-1, 6) for t in xs]).double()  # every rank a different chunk
        whole.requires_grad_(True)
        h = nn.functional.linear(whole, reference["fc1.weight"], reference["fc1.bias"])
        h.retain_grad()
        y = nn.functional.linear(h, reference["fc2.weight"], reference["fc2.bias"])
        y.retain_grad()
        y.pow(2).sum().backward()
        records = list(dm.read_jsonl(f"{out}/metrics.jsonl")) if rank == 0 else []
        results[case] = {"truth": {("fc1", "activation"): h, ("fc1", "input"): whole, ("fc1", "gradient"): h.grad,
                                   ("fc2", "activation"): y, ("fc2", "input"): h, ("fc2", "gradient"): y.grad},
                         "got": [r for r in records if r["kind"] == "tensor_stats"],
                         "tokens": [r["train/consumed_tokens"] for r in records if r["kind"] == "train"]}
        results[case]["truth"] = {key: {stat: _expected(t.detach().reshape(-1).tolist(), stat) for stat in stats}
                                  for key, t in results[case]["truth"].items()}
    return results


def test_tensor_and_context_parallel_activations_are_those_of_the_whole_tensor(tmp_path):
    """Activations were measured on TP/CP rank 0 only: a column-parallel layer's output (half of it
    on each TP rank) and context parallelism's sequence chunks were described by one piece (l1_norm
    half the whole's). A piece counts on every rank; a copy (a row-parallel layer's all-reduced
    output, fc1's input on TP peers) once. Without device_mesh the mesh is read from the model's
    DTensors: copies counted once per TP rank (l1_norm x2) and so were the batch's tokens."""
    results = run_ranks(_tp_and_cp_activations, 4, str(tmp_path), timeout=240)[0]
    for parallel, result in results.items():
        assert result["tokens"] == [2 * 8], (parallel, result["tokens"])  # 2 replicas of 8 tokens
        (record,) = result["got"]
        for (layer, tensor), truth in result["truth"].items():
            for stat, value in truth.items():
                got = record[f"tensor_stats/{layer}/{tensor}/{stat}"]
                # the model runs in float32
                assert got == pytest.approx(value, rel=1e-5, abs=1e-6), (parallel, layer, tensor, stat, got, value)


def test_the_features_digest_compared_at_start_up_reads_content_not_layout():
    """The same content in another key order has one digest; statistics listed in another order do not
    (each rank merged only with the ranks listing them alike); keys of mixed types (YAML's 1: beside
    text) digest too (sorting them raised TypeError, on one rank alone where the files differed)."""
    from distmetrics.tensor_stats.lifecycle import _digest

    stats = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "mean"]}}
    one = {"a": {"enabled": True, "layers": {"layer_types": ["fc1"]}, "distmetrics": stats}, "b": {"enabled": False}}
    assert _digest(one) == _digest(dict(reversed(list(one.items()))))
    reordered = {"LogTensorStats": {**stats["LogTensorStats"], "stats": ["mean", "max"]}}
    other = {"a": {**one["a"], "distmetrics": reordered},
             "b": {"enabled": False}}
    assert _digest(one) != _digest(other)
    assert _digest({1: {"enabled": False}, "a": one["a"]}).startswith("content ")


@pytest.mark.parametrize("section,message", [
    ("enabled: 'false'", "section 's': enabled must be true or false (unquoted), got str 'false'"),
    ("enabled: true\n    distmetrics:\n      LogTensorStats: {enabled: 'no', tensors: [activation], stats: [max]}",
     "distmetrics.LogTensorStats: enabled must be true or false (unquoted), got str 'no'"),
    ("enabled: true\n    distmetrics:\n      LogTensorStats: {enabled: true, tensors: [activation], stats: [max], "
     "start_step: 10, end_step: 2}", "end_step 2 for tensor 'activation' is before start_step 10: no step is selected"),
])
def test_a_quoted_enabled_and_an_end_before_the_start_are_refused(tmp_path, section, message):
    """``enabled: 'false'`` (text, which nvdlfw-inspect tests for truth) turned the section on; an
    end_step before the start_step was taken and collected nothing, without a word."""
    from distmetrics.config import ConfigError
    from distmetrics.tensor_stats.features import load_features

    path = tmp_path / "features.yaml"
    path.write_text(f"s:\n    {section}\n    layers: {{layer_name_regex_pattern: fc1}}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_features(str(path))


@pytest.mark.parametrize("wrap", ["torch.compile", "checkpoint wrapper", "both"])
def test_a_wrapped_model_gets_the_statistics_and_names_of_the_bare_one(tmp_path, wrap):
    """Under torch.compile the first forward raised InternalTorchDynamoError (ModuleNotFoundError: No
    module named 'distmetrics_stats'): Dynamo traced our hook into nvdlfw-inspect's feature. And the
    statistics kept the wrapper levels that norm names drop (tensor_stats/_orig_mod.fc1/...,
    tensor_stats/_checkpoint_wrapped_module.fc1/...), so a layer changed its name with a wrapper."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"fc1$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                          "stats": ["max", "l1_norm"], "freq": 1}}}}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    got = {}
    for case in ("bare", wrap):
        model = torch.nn.Sequential()
        model.add_module("block", _model())
        if case in ("checkpoint wrapper", "both"):  # model.block._checkpoint_wrapped_module.fc1
            apply_activation_checkpointing(model, check_fn=lambda m, block=model.block: m is block)
        if case in ("torch.compile", "both"):
            model = torch.compile(model, backend="eager")
        out = tmp_path / case.replace(" ", "_")
        cfg = dm.MetricsConfig(output_dir=str(out), log_interval=1, console=False, tensorboard=False,
                               timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
        with dm.Monitor(cfg, model=model) as monitor:
            model(x).sum().backward()
            monitor.step(1)
        (record,) = [r for r in dm.read_jsonl(out / "metrics.jsonl") if r["kind"] == "tensor_stats"]
        got[case] = {k: v for k, v in record.items() if k.startswith("tensor_stats/")}
    assert sorted(got["bare"]) == [f"tensor_stats/block.fc1/activation/{stat}" for stat in ("l1_norm", "max")]
    assert got[wrap] == pytest.approx(got["bare"], rel=1e-6)


def _log_dir_unmakeable_on(rank: int, world: int, root: str, key: str) -> tuple:
    import distmetrics as dm

    features = Path(root) / f"features{rank}.yaml"
    features.write_text(FEATURES)
    blocker = Path(root) / f"a_file{rank}"
    blocker.write_text("")  # a folder under a file cannot be made
    bad = str(blocker / "sub")
    inspect = {"enabled": True, "features": str(features)}
    if key == "tensor_inspect.log_dir":
        inspect["log_dir"] = bad if rank == 1 else f"{root}/logs{rank}"
    out = bad if key == "output_dir" and rank == 1 else f"{root}/out{rank}"
    cfg = dm.MetricsConfig(output_dir=out, tensorboard=False, console=False, json_log=False, log_progress=False,
                           hang_timeout_s=20, tensor_inspect=inspect)
    try:
        dm.Monitor(cfg, model=_model()).close()
        return "no error", None
    except ValueError as err:
        return str(err), type(err).__name__


@pytest.mark.parametrize("key", ["tensor_inspect.log_dir", "output_dir"])
def test_a_log_folder_one_rank_cannot_make_is_raised_on_every_rank(tmp_path, key):
    """nvdlfw-inspect's log folder was made after the start-up check: the rank that could not make
    it raised a bare NotADirectoryError, and the other waited in the statistics' first collective
    (not covered by hang_timeout_s) until that rank's process ended."""
    for message, kind in run_ranks(_log_dir_unmakeable_on, 2, str(tmp_path), key, timeout=120):
        assert kind == "ConfigError" and f"rank 1: {key}: nvdlfw-inspect's log folder" in message, (kind, message)
        assert "a_file1 is not a folder" in message, message


def _init_step_differs(rank: int, world: int, root: str) -> tuple:
    import distmetrics as dm

    features = Path(root) / f"features{rank}.yaml"
    features.write_text(FEATURES)
    cfg = dm.MetricsConfig(output_dir=f"{root}/out", tensorboard=False, console=False, hang_timeout_s=20,
                           tensor_inspect={"enabled": True, "features": str(features),
                                           "init_training_step": 3 * rank})
    try:
        dm.Monitor(cfg, model=_model()).close()
        return "no error"
    except ValueError as err:
        return str(err)


def test_an_init_training_step_that_differs_between_ranks_is_refused_at_start(tmp_path):
    """It decides at which steps the statistics' collective runs: ranks given 0 and 3 met at
    different steps, and raised a HangError blaming the loop's calls after hang_timeout_s, with
    no train record written."""
    for message in run_ranks(_init_step_differs, 2, str(tmp_path), timeout=120):
        assert "tensor_inspect.init_training_step" in message and "differs between ranks" in message, message


@pytest.mark.parametrize("value,message", [
    ({"features": ""}, "tensor_inspect.features='': give a features YAML path"),
    ({"features": "f.yaml", "feature_dirs": [None]}, "tensor_inspect.feature_dirs=[None]: accepted values are a list"),
])
def test_an_empty_features_path_or_a_feature_folder_that_is_no_path_is_named(value, message):
    """features="" was read as the folder '.'; feature_dirs=[None] raised a bare TypeError from os.stat."""
    import distmetrics as dm

    with pytest.raises(dm.ConfigError, match=re.escape(message)):
        dm.MetricsConfig(tensor_inspect=value)


# --- layer names as the model gives them --------------------------------------------------------

def _named_layers(rank: int, world: int, root: str) -> dict:
    """Two scenarios on every rank, activation statistics of every ``fc`` at step 1: a ModuleDict
    key holding ``|``; under DDP, a model's own submodule ``module`` beside a sibling ``fc``.
    Returns the float64 truth of each layer's activations, gathered over the ranks."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.ModuleDict({"fc": nn.Linear(3, 3)})  # the model's own, not DDP's level
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.module["fc"](x).sum() + 2 * self.fc(x).sum()

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"fc$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                          "stats": ["max", "mean"], "freq": 1}}}}
    x = torch.randn(2 + rank, 3, generator=torch.Generator().manual_seed(rank))  # ranks hold different batches
    torch.manual_seed(0)
    pipe = nn.ModuleDict({"a|b": nn.ModuleDict({"fc": nn.Linear(3, 3)}), "c": nn.ModuleDict({"fc": nn.Linear(3, 3)})})
    net = DistributedDataParallel(Net())
    layers = {"pipe": {"a|b.fc": pipe["a|b"]["fc"], "c.fc": pipe["c"]["fc"]},
              "module": {"module.fc": net.module.module["fc"], "fc": net.module.fc}}
    out = {}
    for case, model in (("pipe", pipe), ("module", net)):
        cfg = dm.MetricsConfig(output_dir=f"{root}/{case}{rank}", log_interval=1, console=False, tensorboard=False,
                               timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
        out[case] = {}
        with dm.Monitor(cfg, model=model) as monitor:
            if case == "pipe":
                sum(layer(x).sum() for layer in layers[case].values()).backward()
            else:
                model(x).backward()
                monitor.clip_grad_norm_(math.inf)
            try:  # the same error on every rank: the next scenario still runs
                monitor.step(1, loss=1.0)
            except ValueError as err:
                out[case]["error"] = f"monitor.step raised {err!r}"
        for name, layer in layers[case].items():
            activation = _gather(torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double()))
            out[case][name] = {"max": float(activation.max()), "mean": float(activation.mean())}
    return out


@pytest.fixture(scope="module")
def named_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("named_layers")
    return root, run_ranks(_named_layers, 2, str(root), timeout=240)[0]


def _records(folder) -> dict:
    import distmetrics as dm

    return {r["kind"]: r for r in dm.read_jsonl(folder / "metrics.jsonl") if r["kind"] in ("train", "tensor_stats")}


def test_a_layer_name_holding_a_pipe_gets_its_statistics_and_the_step_its_record(named_layers):
    """A ModuleDict key ``a|b``: the statistics' internal names are ``|``-separated, and their split
    raised ValueError (too many values to unpack) in monitor.step at every selected step, losing the
    tensor_stats record and the step's train record with it."""
    root, truth = named_layers
    assert "error" not in truth["pipe"], truth["pipe"]["error"]
    records = _records(root / "pipe0")
    assert records["train"]["train/loss"] == 1.0
    written = {k: v for k, v in records["tensor_stats"].items() if k.startswith("tensor_stats/")}
    expected = {f"tensor_stats/{layer}/activation/{stat}": value
                for layer, stats in truth["pipe"].items() for stat, value in stats.items()}
    assert written == pytest.approx(expected, rel=1e-6)


def test_a_submodule_named_module_keeps_its_name_in_statistics_as_in_norm_names(named_layers):
    """A model's own ``self.module`` beside ``self.fc`` (under DDP, whose ``module`` level goes):
    statistics names dropped every ``module`` level, so module.fc and fc wrote one key,
    tensor_stats/fc/..., holding module.fc's values; norm names keep module.fc apart."""
    root, truth = named_layers
    assert "error" not in truth["module"], truth["module"]["error"]
    records = _records(root / "module0")
    written = {k: v for k, v in records["tensor_stats"].items() if k.startswith("tensor_stats/")}
    expected = {f"tensor_stats/{layer}/activation/{stat}": value
                for layer, stats in truth["module"].items() for stat, value in stats.items()}
    assert written == pytest.approx(expected, rel=1e-6)
    assert {"grad_norm/module.fc", "grad_norm/fc"} <= set(records["train"])  # the same names


def _root_beside_a_child_named_model(rank: int, world: int, root: str) -> dict:
    """A Hugging-Face-shaped model, ``Outer(model=Inner(fc1), lm_head)``, bare and under DDP, every
    layer selected (``.*``) for its activation at step 1; then blocks of a ModuleList carrying one
    ``layer_number``. Returns each case's float64 truth per layer (or the error raised)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc1(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(4, 2)

        def forward(self, x):
            return self.lm_head(self.model(x))

    class Block(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.layer_number = 1  # both: nvdlfw-inspect names both model.layers.1

    def config(case: str, pattern: str) -> dm.MetricsConfig:
        features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern},
                          "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                              "stats": ["max", "l1_norm"], "freq": 1}}}}
        return dm.MetricsConfig(output_dir=f"{root}/{case}", log_interval=1, console=False, tensorboard=False,
                                timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})

    out: dict = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    for case in ("bare", "ddp"):
        torch.manual_seed(0)
        outer = Outer()
        model = outer if case == "bare" else DistributedDataParallel(outer)
        layers = {"root": outer, "model": outer.model, "model.fc1": outer.model.fc1, "lm_head": outer.lm_head}
        seen: dict = {}
        for name, layer in layers.items():  # the test's own capture: ground truth
            layer.register_forward_hook(lambda mod, args, output, name=name: seen.__setitem__(name, output.detach()))
        with dm.Monitor(config(case, ".*"), model=model) as monitor:
            model(x).sum().backward()
            monitor.step(1, loss=1.0)
        out[case] = {name: {"max": float(_gather(t.double().reshape(-1)).max()),
                            "l1_norm": float(_gather(t.double().reshape(-1)).abs().sum())} for name, t in seen.items()}
    try:
        blocks = nn.Module()
        blocks.layers = nn.ModuleList([Block(), Block()])
        with dm.Monitor(config("same_number", r"layers\.1$"), model=blocks) as monitor:
            monitor.step(1, loss=1.0)
    except ValueError as err:
        out["same_number"] = str(err)
    return out


def test_the_root_and_a_child_named_model_keep_their_own_statistics_and_two_layers_of_one_name_are_refused(tmp_path):
    """Hugging Face's ``*ForCausalLM`` hold ``self.model``: nvdlfw-inspect names it ``model.model``
    and the root ``model``, and both were written as ``tensor_stats/model/...``, the root's values
    dropped without a word (taken for a wrapper of the child). The root is ``root`` then, as in
    norm names; under DDP its wrapper level still merges with it. Two modules nvdlfw-inspect gives
    one name (blocks carrying one ``layer_number``) are refused naming both, not mixed."""
    truth = run_ranks(_root_beside_a_child_named_model, 1, str(tmp_path), timeout=240)[0]
    for case in ("bare", "ddp"):
        written = _tensor_stats_by_step(tmp_path / case)[1]
        expected = {f"tensor_stats/{layer}/activation/{stat}": value
                    for layer, stats in truth[case].items() for stat, value in stats.items()}
        assert written == pytest.approx(expected, rel=1e-9), case
    assert truth["bare"]["root"]["max"] != pytest.approx(truth["bare"]["model"]["max"])  # a test that tells them apart
    refused = truth.get("same_number", "not refused")
    assert "'model.layers.1' (the Block at 'layers.0')" in refused and "(the Block at 'layers.1')" in refused, refused


# --- what a layer's tensors are, however it is called or wrapped ---------------------------------

def _layer_tensors(rank: int, world: int, root: str) -> dict:
    """Two scenarios, two steps each, on every rank. ``mixed``: FSDP2 with
    MixedPrecisionPolicy(param_dtype=bf16), ``weight`` statistics of a layer that is its own unit
    (fc1), one nested in a unit (blk.fc2), one in the root's unit (fc3) and one that is its own
    unit with reshard_after_forward=False (fc4), an SGD step between the steps; returns the float64
    truth of each full fp32 parameter and of its bf16 copy. ``calls``: fc1 called with its input
    as a keyword argument, a module returning a dict, a Sequential asked for its weight; returns the
    gathered inputs and activations and the warnings this rank gave."""
    import logging

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import distmetrics as dm

    def features(pattern: str, tensors: list) -> dict:
        return {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": tensors,
                                                          "stats": ["min", "max", "std", "l2_norm"], "freq": 1}}}}

    def config(case: str, feats: dict, **extra) -> dm.MetricsConfig:
        return dm.MetricsConfig(output_dir=f"{root}/{case}", log_interval=1, console=False, tensorboard=False,
                                timing_log_level=-1, tensor_inspect={"enabled": True, "features": feats}, **extra)

    def stats(t) -> dict:
        t = t.detach().double().reshape(-1)
        return {"min": float(t.min()), "max": float(t.max()), "std": float(t.std()), "l2_norm": float(t.norm())}

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(6, 8))
    model.add_module("blk", nn.Sequential())
    model.blk.add_module("fc2", nn.Linear(8, 8))
    model.add_module("fc3", nn.Linear(8, 8))
    model.add_module("fc4", nn.Linear(8, 3))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model.fc1, mesh=mesh, mp_policy=policy)
    fully_shard(model.blk, mesh=mesh, mp_policy=policy)
    fully_shard(model.fc4, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    layers = {"fc1": model.fc1, "blk.fc2": model.blk.fc2, "fc3": model.fc3, "fc4": model.fc4}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mixed: dict = {}
    with dm.Monitor(config("mixed", features(r"fc\d$", ["weight"])), model=model, device_mesh=mesh) as monitor:
        for step in (1, 2):
            full = {name: layer.weight.full_tensor() for name, layer in layers.items()}  # fp32, the optimizer's
            mixed[step] = {name: {"fp32": stats(w), "bf16": stats(w.to(torch.bfloat16))} for name, w in full.items()}
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step)

    class DictOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 2)

        def forward(self, x):
            return {"out": self.fc(x)}

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(6, 4))
    model.add_module("blk", nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    model.add_module("d", DictOutput())
    feats = {**features(r"fc1$", ["input"]), "block": features(r"blk$", ["weight", "activation"])["s"],
             "dict": features(r"\.d$", ["activation", "gradient"])["s"]}
    warnings: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    calls: dict = {}
    try:
        with dm.Monitor(config("calls", feats), model=model) as monitor:
            for step in (1, 2):
                x = torch.randn(3 + rank, 6, generator=torch.Generator().manual_seed(100 * step + rank))
                hidden = model.fc1(input=x)
                activation = model.blk(hidden)
                (activation.sum() + model.d(x)["out"].sum()).backward()
                calls[step] = {"input": stats(_gather(x)), "activation": stats(_gather(activation))}
                monitor.step(step)
    finally:
        logging.getLogger("distmetrics").removeHandler(handler)
    return {"mixed": mixed, "calls": calls, "warnings": [w for w in warnings if "has none to measure" in w]}


@pytest.fixture(scope="module")
def layer_tensors(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer_tensors")
    return root, run_ranks(_layer_tensors, 2, str(root), timeout=240)


def _tensor_stats_by_step(folder) -> dict:
    import distmetrics as dm

    return {r["step"]: {k: v for k, v in r.items() if k.startswith("tensor_stats/")}
            for r in dm.read_jsonl(folder / "metrics.jsonl") if r["kind"] == "tensor_stats"}


def test_a_weight_under_fsdp2_mixed_precision_is_the_fp32_parameter_however_its_layer_is_wrapped(layer_tensors):
    """Under MixedPrecisionPolicy(param_dtype=bf16) a layer's weight statistics depended on its
    wrapping: its own unit gave the fp32 sharded parameter, a layer nested in a unit, in the root's
    or under reshard_after_forward=False the bf16 compute copy (l2_norm 1.22816 for 1.22840). Every
    layer gives the parameter the optimizer steps, as param_norm does."""
    root, ranks = layer_tensors
    records = _tensor_stats_by_step(root / "mixed")
    assert sorted(records) == [1, 2]
    for step, layers in ranks[0]["mixed"].items():
        for layer, truth in layers.items():
            # the bf16 copy differs: a test that tells the two apart
            assert truth["bf16"]["l2_norm"] != pytest.approx(truth["fp32"]["l2_norm"], rel=1e-6), (step, layer)
            for stat, value in truth["fp32"].items():
                got = records[step].get(f"tensor_stats/{layer}/weight/{stat}")
                assert got == pytest.approx(value, rel=1e-9), (step, layer, stat, got, value)


def test_an_input_given_by_keyword_is_measured_and_a_tensor_a_layer_cannot_give_is_named_once(layer_tensors):
    """``fc1(input=x)`` passes no positional argument: its input was dropped. A module returning a
    dict has no activation or gradient to measure, a Sequential no weight: they were dropped with,
    at best, a warning that the section yielded nothing. Keyword inputs count; each tensor a layer
    cannot give is named once per layer and tensor with the reason, by the first rank, for all steps."""
    root, ranks = layer_tensors
    records = _tensor_stats_by_step(root / "calls")
    assert sorted(records) == [1, 2]
    for step, truth in ranks[0]["calls"].items():
        expected = {f"tensor_stats/fc1/input/{stat}": value for stat, value in truth["input"].items()}
        expected.update({f"tensor_stats/blk/activation/{stat}": value for stat, value in truth["activation"].items()})
        assert records[step] == pytest.approx(expected, rel=1e-9), step
    said = ranks[0]["warnings"]
    assert len(said) == 3 and not ranks[1]["warnings"], ranks
    assert "tensor 'weight' on layer 'model.blk'" in said[0] and "a Sequential has no 'weight' tensor" in said[0]
    for tensor, message in zip(("activation", "gradient"), said[1:]):
        assert f"tensor {tensor!r} on layer 'model.d'" in message and "its output is a dict" in message


def _unmeasured(rank: int, world: int, root: str) -> dict:
    """Two scenarios on every rank, each with the warnings this rank gave. ``frozen``: the gradient
    statistics of fc1 and fc2, fc1 frozen (and first: its output needs no gradient) at steps 1 and 2
    only, with an evaluation forward and a train-mode forward under no_grad each step; returns the
    float64 truth of every gradient backward gave. ``empty``: fc1's activation, empty on every rank
    at step 1 and on rank 1 at step 2; returns the truth of step 2's."""
    import logging

    import torch
    from torch import nn

    import distmetrics as dm

    def config(case: str, pattern: str, tensors: list) -> dm.MetricsConfig:
        features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern},
                          "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": tensors,
                                                              "stats": ["max", "std", "l2_norm"], "freq": 1}}}}
        return dm.MetricsConfig(output_dir=f"{root}/{case}", log_interval=1, console=False, tensorboard=False,
                                timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})

    def stats(t) -> dict:
        t = _gather(t.detach().double().reshape(-1))
        return {"max": float(t.max()), "std": float(t.std()), "l2_norm": float(t.norm())}

    def batch(step: int, rows: int):
        return torch.randn(rows, 6, generator=torch.Generator().manual_seed(10 * step + rank))

    out: dict = {}
    warnings: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    try:
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("fc1", nn.Linear(6, 4))
        model.add_module("fc2", nn.Linear(4, 2))
        grads: dict = {}

        def spy(mod, args, output, name):  # the test's own capture: ground truth
            if output.requires_grad:
                output.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))

        for name in ("fc1", "fc2"):
            getattr(model, name).register_forward_hook(
                lambda mod, args, output, name=name: spy(mod, args, output, name))
        truth: dict = {}
        with dm.Monitor(config("frozen", r"fc\d$", ["gradient"]), model=model) as monitor:
            for step in (1, 2, 3):
                model.fc1.requires_grad_(step == 3)
                model.eval()
                with torch.no_grad():
                    model(batch(step, 5))
                model.train()
                with torch.no_grad():
                    model(batch(step, 5))
                grads.clear()
                model(batch(step, 3)).pow(2).sum().backward()
                truth[step] = {name: stats(g) for name, g in grads.items()}
                model.zero_grad()
                monitor.step(step)
        out["frozen"] = {"truth": truth, "warnings": warnings[:]}
        del warnings[:]
        with dm.Monitor(config("empty", r"fc1$", ["activation"]), model=model) as monitor:
            for step in (1, 2):
                activation = model.fc1(batch(step, 3 if step == 2 and rank == 0 else 0))
                model.fc2(activation).sum().backward()
                monitor.step(step)
        out["empty"] = {"truth": stats(activation), "warnings": warnings[:]}
        del warnings[:]

        class Router(nn.Module):  # trainable, but what it returns first is integer indices
            def __init__(self) -> None:
                super().__init__()
                self.gate = nn.Linear(6, 4)

            def forward(self, x):
                probs = self.gate(x).softmax(-1)
                return probs.argmax(-1), probs

        router = Router()
        with dm.Monitor(config("router", r"router$", ["gradient"]), model=nn.ModuleDict({"router": router})) as monitor:
            router(batch(1, 3))[1].sum().backward()
            monitor.step(1)
        out["router"] = warnings[:]
    finally:
        logging.getLogger("distmetrics").removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def unmeasured(tmp_path_factory):
    root = tmp_path_factory.mktemp("unmeasured")
    return root, run_ranks(_unmeasured, 2, str(root), timeout=240)


def test_a_selected_gradient_a_frozen_layer_never_gets_is_named_once(unmeasured):
    """A frozen first layer's output needs no gradient, so backward never reaches it: its selected
    gradient was dropped without a word. It is named once, by the first rank, with the reason and
    the first step; evaluation and no_grad forwards say nothing, and once the layer trains again
    its gradient is written."""
    root, ranks = unmeasured
    records = _tensor_stats_by_step(root / "frozen")
    assert sorted(records) == [1, 2, 3]
    for step, layers in ranks[0]["frozen"]["truth"].items():
        assert sorted(layers) == (["fc1", "fc2"] if step == 3 else ["fc2"]), (step, layers)
        expected = {f"tensor_stats/{layer}/gradient/{stat}": value
                    for layer, stats in layers.items() for stat, value in stats.items()}
        assert records[step] == pytest.approx(expected, rel=1e-9), step
    said = [w for w in ranks[0]["frozen"]["warnings"] if "has none to measure" in w]
    assert len(said) == 1 and not ranks[1]["frozen"]["warnings"], ranks
    assert "tensor 'gradient' on layer 'model.fc1'" in said[0], said
    assert "needed no gradient in the training forward of step 1" in said[0] and "frozen" in said[0], said
    said = [w for w in ranks[0]["router"] if "has none to measure" in w]  # not frozen: its output is indices
    assert len(said) == 1 and "has trainable parameters" in said[0] and "frozen" not in said[0], said


def test_a_section_whose_tensors_were_empty_on_every_rank_says_so(unmeasured):
    """fc1 ran on an empty batch on every rank: the warning that no value came advised running the
    layer in a training forward, which it was. It says the tensors were empty; a step where some
    ranks' are empty is measured over the others' values."""
    root, ranks = unmeasured
    records = _tensor_stats_by_step(root / "empty")
    assert sorted(records) == [2]
    expected = {f"tensor_stats/fc1/activation/{stat}": value for stat, value in ranks[0]["empty"]["truth"].items()}
    assert records[2] == pytest.approx(expected, rel=1e-9)
    said = [w for w in ranks[0]["empty"]["warnings"] if "no value came" in w]
    assert len(said) == 1 and not ranks[1]["empty"]["warnings"], ranks
    assert "selects step 1" in said[0] and "tensors were empty (0 elements) on every rank" in said[0], said
    assert "model.fc1 activation" in said[0] and "training forward" not in said[0], said


def _replicated_weights(rank: int, world: int, root: str) -> dict:
    """A DDP model's fc2 (weight and activation statistics, every step): rank 0 skips fc2 at step 1
    (layer drop), also with the Monitor given a data-parallel DeviceMesh; then a Monitor per rank, each on
    its own group of itself. Truth:
    float64 of the weight and of every rank's fc2 output, captured by the test's own hook."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc2$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["weight", "activation"],
                                                         "stats": ["l2_norm", "max"]}}}}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.skip = nn.Linear(4, 4), nn.Linear(4, 4), False

        def forward(self, x):
            h = self.fc1(x)
            return h if self.skip else self.fc2(h)

    def config(out):
        return dm.MetricsConfig(output_dir=out, console=False, tensorboard=False, log_progress=False,
                                timing_log_level=-1, log_interval=100, tensor_inspect={"enabled": True,
                                                                                       "features": features})

    torch.manual_seed(0)
    net = Net()
    outputs: list = []
    net.fc2.register_forward_hook(lambda mod, args, out: mod is net.fc2 and outputs.append(out.detach().double()))
    truth: dict = {"ddp": {}, "own group": {}}
    monitor = dm.Monitor(config(f"{root}/ddp"), model=nn.parallel.DistributedDataParallel(
        net, find_unused_parameters=True))
    for step in (1, 2):
        net.skip = step == 1 and rank == 0
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        outputs.clear()
        monitor.model(x).sum().backward()
        parts = [None] * world
        dist.all_gather_object(parts, torch.cat([o.reshape(-1) for o in outputs]) if outputs else torch.zeros(0))
        truth["ddp"][step] = {"weight/l2_norm": float(net.fc2.weight.detach().double().norm()),
                              "weight/max": float(net.fc2.weight.detach().max()),
                              "activation/max": float(torch.cat(parts).max())}
        monitor.step(step)
    monitor.close()
    from torch.distributed.device_mesh import init_device_mesh  # the same skip, the Monitor given a data-parallel mesh

    monitor = dm.Monitor(config(f"{root}/mesh"), model=net, device_mesh=init_device_mesh("cpu", (world,),
                                                                                         mesh_dim_names=("dp",)))
    net.skip = rank == 0
    net(torch.randn(3, 4)).sum().backward()
    truth["mesh"] = {"weight/l2_norm": float(net.fc2.weight.detach().double().norm())}
    monitor.step(1)
    monitor.close()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    net.skip = False
    monitor = dm.Monitor(config(f"{root}/own{rank}"), model=net, group=groups[rank])
    with torch.no_grad():
        net.fc2.weight.mul_(1 + rank)  # each rank's own weights
    net(torch.randn(3, 4)).sum().backward()
    truth["own group"] = {"weight/l2_norm": float(net.fc2.weight.detach().double().norm())}
    monitor.step(1)
    monitor.close()
    return truth


def test_a_replicated_weight_is_written_once_whichever_rank_runs_its_layer(tmp_path):
    """Only global rank 0's copy of a DDP weight was measured: a layer rank 0 skipped in a step (layer
    drop, an expert no token reached) had no weight statistics, and a Monitor on a group without global
    rank 0 (a Monitor per rank) never wrote one, all without a word; on a DeviceMesh, where the weights are
    plain copies too, data-parallel rank 0's copy alone was still measured. Now the lowest rank that ran the
    layer gives the weight, counted once."""
    truth = run_ranks(_replicated_weights, 2, str(tmp_path), timeout=240)
    written = _tensor_stats_by_step(tmp_path / "ddp")
    assert sorted(written) == [1, 2], written
    for step, expected in truth[0]["ddp"].items():
        got = {k.split("/", 2)[2]: v for k, v in written[step].items() if k.split("/", 2)[2] in expected}
        assert got == pytest.approx(expected, rel=1e-6), (step, got, expected)
    got = _tensor_stats_by_step(tmp_path / "mesh")[1]  # plain weights on a mesh: rank 0's copy alone was measured
    assert got.get("tensor_stats/fc2/weight/l2_norm") == pytest.approx(truth[0]["mesh"]["weight/l2_norm"]), got
    for rank in (0, 1):
        got = _tensor_stats_by_step(tmp_path / f"own{rank}")[1]
        assert got["tensor_stats/fc2/weight/l2_norm"] == pytest.approx(truth[rank]["own group"]["weight/l2_norm"],
                                                                       rel=1e-6), (rank, got)


def _stages_named_alike(rank: int, world: int, root: str) -> dict:
    """Two pipeline stages on a (pp, dp) = (2, 1) mesh, each building its own ``fc1``, ``fc2``: names collide
    across stages. Truth: float64 of each stage's own weight and fc2 output, taken by the test's own hook."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc2$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["weight", "activation"],
                                                         "stats": ["l2_norm", "max"]}}}}
    torch.manual_seed(100 + rank)  # each stage its own weights
    net = nn.Sequential()
    net.add_module("fc1", nn.Linear(4, 4))
    net.add_module("fc2", nn.Linear(4, 4))
    outputs = []
    net.fc2.register_forward_hook(lambda m, i, o: outputs.append(o.detach().double()))
    cfg = dm.MetricsConfig(output_dir=root, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, log_interval=100,
                           tensor_inspect={"enabled": True, "features": features})
    monitor = dm.Monitor(cfg, model=net, device_mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp")))
    net(torch.randn(3, 4)).sum().backward()
    monitor.step(1)
    monitor.close()
    weight = net.fc2.weight.detach().double()
    return {f"tensor_stats/stage{rank}.fc2/weight/l2_norm": float(weight.norm()),
            f"tensor_stats/stage{rank}.fc2/weight/max": float(weight.max()),
            f"tensor_stats/stage{rank}.fc2/activation/l2_norm": float(outputs[0].norm()),
            f"tensor_stats/stage{rank}.fc2/activation/max": float(outputs[0].max())}


def test_pipeline_stages_whose_module_names_collide_each_get_their_own_statistics(tmp_path):
    """Stages naming their modules alike (a model split by hand): the norms name each stage's modules with
    its stage, but tensor statistics merged both stages' activations under one name and wrote the first
    stage's weight alone. They take the stage prefix the norms take."""
    truth = run_ranks(_stages_named_alike, 2, str(tmp_path), timeout=180)
    written = _tensor_stats_by_step(tmp_path)[1]
    assert written == pytest.approx({**truth[0], **truth[1]}, rel=1e-6), written


def _sharded_layer_dropped(rank: int, world: int, root: str) -> dict:
    """FSDP2 on 2 ranks; rank 1 skips fc_b at step 2 (layer drop; the usual zero term keeps FSDP2's
    gradients in step). Truth: full_tensor() of the sharded weight before each step, and the fc_b output
    of each rank that ran it, both float64."""
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_a, self.fc_b, self.skip = nn.Linear(8, 8), nn.Linear(8, 8), False

        def forward(self, x):
            h = self.fc_a(x)
            if self.skip:
                return h + 0 * (self.fc_b.weight.sum() + self.fc_b.bias.sum())
            return h + self.fc_b(h)

    torch.manual_seed(0)
    model = Net()
    outputs: list = []
    model.fc_b.register_forward_hook(lambda m, i, o: outputs.append(o.detach().double()))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model, mesh=mesh)
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"fc_b$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["weight", "activation"],
                                                         "stats": ["l1_norm"]}}}}
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           tensor_inspect={"enabled": True, "features": features})
    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truth: dict = {}
    with dm.Monitor(cfg, model=model, optimizer=opt, device_mesh=mesh) as monitor:
        for step in (1, 2, 3):
            weight = model.fc_b.weight.full_tensor().double()
            model.skip = step == 2 and rank == 1
            outputs.clear()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))).pow(2).mean().backward()
            parts = [None] * world
            dist.all_gather_object(parts, torch.cat([o.reshape(-1) for o in outputs]) if outputs else torch.zeros(0))
            truth[step] = {"weight/l1_norm": float(weight.abs().sum()),
                           "activation/l1_norm": float(torch.cat(parts).abs().sum())}
            opt.step()
            opt.zero_grad()
            monitor.step(step)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"truth": truth, "said": [line for line in said if "tensor_stats" in line or "no value came" in line]}


def test_a_sharded_weight_a_rank_did_not_measure_is_left_out_and_said_not_written_from_the_other_shards(tmp_path):
    """FSDP2 measures a weight in its layer's forward: at a step where a rank skipped the layer (layer drop),
    its shard was missing and the weight's statistics were the other shards' (half the l1_norm), unsaid.
    Such a weight is now left out of that step's record and named once; the other steps and the
    activations are exact."""
    out = run_ranks(_sharded_layer_dropped, 2, str(tmp_path), timeout=240)
    written = _tensor_stats_by_step(tmp_path)
    truth = out[0]["truth"]
    for step in (1, 3):
        assert written[step] == pytest.approx({f"tensor_stats/fc_b/{k}": v for k, v in truth[step].items()},
                                              rel=1e-6), (step, written[step])
    assert written[2] == pytest.approx({"tensor_stats/fc_b/activation/l1_norm": truth[2]["activation/l1_norm"]},
                                       rel=1e-6), written[2]
    assert out[0]["said"] == ["distmetrics: tensor_stats/<layer>/weight at step 2 is left out for fc_b (rank 1): the "
                              "rank(s) holding a shard of it that did not run the layer in the step (layer drop) "
                              "measured no shard, and the others' shards are not the weight (said once per layer)"]
    assert out[1]["said"] == [], out[1]


def test_a_copy_of_the_model_made_after_the_monitor_adds_nothing_to_its_statistics(tmp_path):
    """copy.deepcopy of a hooked model (an EMA or teacher made after the Monitor) copies its forward
    hooks: the teacher's training-mode forwards, under torch.no_grad(), went into the student's
    activation statistics (max 79.6 where the student's is 1.09). A DataParallel replica's forward is
    the module's own, and counts."""
    import copy

    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"^model\.0$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                         "stats": ["max", "l1_norm"]}}}}
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False,
                                          log_progress=False, timing_log_level=-1, log_interval=100,
                                          tensor_inspect={"enabled": True, "features": features}), model=net)
    teacher = copy.deepcopy(net)
    x = torch.randn(3, 4)
    with torch.no_grad():
        teacher(100 * x)
    truth = net[0](x).detach().double()
    net[2](torch.relu(truth.float())).sum().backward()
    monitor.step(1)
    # nn.DataParallel runs each device's forward on a replica that shares the module's hook dicts: the
    # module's own forward, counted (made here on the CPU as DataParallel makes them)
    replica = net._replicate_for_data_parallel()
    for index, layer in enumerate(net):
        replica._modules[str(index)] = layer._replicate_for_data_parallel()
    for name, param in net.named_parameters():
        setattr(replica[int(name.split(".")[0])], name.split(".")[1], param)
    y = torch.randn(2, 4)
    replica(y).sum().backward()
    monitor.step(2)
    monitor.close()
    written = _tensor_stats_by_step(tmp_path)
    assert written[1]["tensor_stats/0/activation/max"] == pytest.approx(float(truth.max()), rel=1e-6), written
    assert written[1]["tensor_stats/0/activation/l1_norm"] == pytest.approx(float(truth.abs().sum()), rel=1e-6)
    replicated = net[0](y).detach().double()
    assert written[2]["tensor_stats/0/activation/max"] == pytest.approx(float(replicated.max()), rel=1e-6), written
    # an EMA kept inside the model (model.ema = deepcopy(model.net)): in the model, but not where the hooked layer is
    holder = torch.nn.Module()
    holder.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    features["s"]["layers"]["layer_name_regex_pattern"] = r"^model\.net\.0$"
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / "ema"), console=False, tensorboard=False,
                                          log_progress=False, timing_log_level=-1, log_interval=100,
                                          tensor_inspect={"enabled": True, "features": features}), model=holder)
    holder.ema = copy.deepcopy(holder.net)
    with torch.no_grad():
        holder.ema(100 * x)
    student = holder.net[0](x).detach().double()
    holder.net[2](torch.relu(student.float())).sum().backward()
    monitor.step(1)
    monitor.close()
    written = _tensor_stats_by_step(tmp_path / "ema")[1]
    assert written["tensor_stats/net.0/activation/max"] == pytest.approx(float(student.max()), rel=1e-6), written


def test_a_layer_swapped_after_the_monitor_by_prepare_qat_is_measured_not_crashed(tmp_path):
    """torch.ao.quantization.prepare_qat after the Monitor swaps each Linear for its QAT version and
    copies the hooks without with_kwargs: the first training forward raised TypeError ("forward_hook()
    missing 1 required positional argument: 'output'") from the Monitor's hook. The swapped-in layer
    is the model's now, and is measured."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"^model\.0$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                         "stats": ["max"]}}}}
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False,
                                          log_progress=False, timing_log_level=-1, log_interval=100,
                                          tensor_inspect={"enabled": True, "features": features}), model=net)
    net.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(net, inplace=True)
    seen: list = []
    net[0].register_forward_hook(lambda module, args, output: seen.append(output.detach().double()))
    net(torch.randn(3, 4)).sum().backward()
    monitor.step(1)
    monitor.close()
    written = _tensor_stats_by_step(tmp_path)[1]
    assert type(net[0]).__module__.startswith("torch.ao.nn.qat"), type(net[0])
    assert written["tensor_stats/0/activation/max"] == pytest.approx(float(seen[0].max()), rel=1e-6), written
