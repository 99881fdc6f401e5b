"""MetricsConfig: every bad key, type and value fails at construction, naming what is accepted."""

import dataclasses
from pathlib import Path

import pytest
import yaml

import distmetrics as dm
from distmetrics.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_yaml_names_every_key_and_loads():
    cfg = dm.MetricsConfig.from_yaml(ROOT / "configs" / "metrics.yaml")
    raw = yaml.safe_load((ROOT / "configs" / "metrics.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(dm.MetricsConfig)}
    assert set(raw) == fields
    inspect_fields = {f.name for f in dataclasses.fields(dm.TensorInspectConfig)}
    assert set(raw["tensor_inspect"]) == inspect_fields
    assert cfg == dm.MetricsConfig()  # the file documents the defaults


def test_unknown_key_names_it_and_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown config key 'log_intervall'.*did you mean 'log_interval'"):
        dm.MetricsConfig.from_dict({"log_intervall": 5})


def test_unknown_nested_key_is_named_with_its_section():
    with pytest.raises(ValueError, match=r"tensor_inspect\.'enable'|'enable'.*tensor_inspect\.'enabled'"):
        dm.MetricsConfig.from_dict({"tensor_inspect": {"enable": True}})


def test_bad_writer_rank_lists_the_accepted_values():
    with pytest.raises(ValueError, match=r"writer_rank='middle'.*'first', 'last'"):
        dm.MetricsConfig(writer_rank="middle")


def test_negative_log_interval_is_rejected():
    with pytest.raises(ValueError, match=r"log_interval=-1: accepted values are integers >= 1"):
        dm.MetricsConfig(log_interval=-1)


def test_wrong_type_is_rejected_with_the_expected_type():
    with pytest.raises(ValueError, match=r"log_interval='10' has type str; accepted: int"):
        dm.MetricsConfig.from_dict({"log_interval": "10"})
    with pytest.raises(ValueError, match=r"json_log=1 has type int; accepted: bool"):
        dm.MetricsConfig(json_log=1)


def test_bad_timing_option_and_level():
    with pytest.raises(ValueError, match="timing_log_option='median'"):
        dm.MetricsConfig(timing_log_option="median")
    with pytest.raises(ValueError, match="timing_log_level=3"):
        dm.MetricsConfig(timing_log_level=3)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_overrides_are_yaml_typed_and_reach_nested_sections(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("log_interval: 3\n")
    cfg = dm.MetricsConfig.from_yaml(path, overrides=["log_interval=7", "writer_rank=last",
                                                      "tensor_inspect.init_training_step=5"])
    assert cfg.log_interval == 7 and cfg.writer_rank == "last"
    assert cfg.tensor_inspect.init_training_step == 5


def test_missing_and_broken_yaml_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        dm.MetricsConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("log_interval: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        dm.MetricsConfig.from_yaml(bad)


def test_secrets_are_redacted_in_the_dict_written_to_records():
    cfg = dm.MetricsConfig(wandb_project="p")
    redacted = cfg.to_dict(redact=True)
    assert redacted["wandb_project"] == "p"
    from distmetrics.config import _redact

    assert _redact({"api_key": "abc", "nested": {"token": "x", "n": 1}}) == \
        {"api_key": "***", "nested": {"token": "***", "n": 1}}


def test_monitor_rejects_a_bad_config_before_any_collective():
    # No process group exists here: a config error must come first, from the constructor.
    with pytest.raises(ValueError, match="log_interval=0"):
        dm.Monitor({"log_interval": 0})
