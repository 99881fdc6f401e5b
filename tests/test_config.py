"""MetricsConfig: every bad key, type and value fails at construction, naming what is accepted."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml

import distmetrics as dm
from distmetrics.config import ConfigError
from tests.dist_utils import run_ranks

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
    with pytest.raises(ValueError, match=r"unknown config key 'LOG_INTERVAL'.*did you mean 'log_interval'"):
        dm.MetricsConfig.from_dict({"LOG_INTERVAL": 5})  # any letter case, as a choice's value is matched


def _nested_aliases(depth: int) -> str:
    """A YAML mapping of ``depth`` lists, each holding the one before ten times (10**depth items expanded)."""
    lines = ["x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 10) + "]" for i in range(1, depth)]
    return "\n".join("    " + line for line in lines) + "\n"


def test_a_yaml_file_of_nested_aliases_past_a_million_items_or_holding_itself_is_refused_at_once(tmp_path):
    """A 450-byte file of nested aliases (a "billion laughs") took its unknown key's message to 80 million
    characters, and its features to a copy 10**7 items long (check-config ran minutes, more with depth);
    a recursive alias raised a RecursionError. Both are refused naming the key; an unknown key's message
    holds the start of its value."""
    unknown, bomb, itself = tmp_path / "unknown.yaml", tmp_path / "features.yaml", tmp_path / "itself.yaml"
    unknown.write_text("bogus_entry:\n" + _nested_aliases(4))
    bomb.write_text("tensor_inspect:\n  features:\n" + _nested_aliases(7))
    itself.write_text("tensor_inspect:\n  features:\n    s: &s [min, *s]\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'bogus_entry' \(value \{'x0': \['lol'") as err:
        dm.MetricsConfig.from_yaml(unknown)
    assert len(str(err.value)) < 1500, len(str(err.value))
    with pytest.raises(ConfigError, match=rf"^{bomb}: tensor_inspect.features.x[0-9](\[[0-9]\])+: its YAML "
                                          r"aliases expand the config past 1,000,000 items"):
        dm.MetricsConfig.from_yaml(bomb)
    with pytest.raises(ConfigError, match=rf"^{itself}: tensor_inspect.features.s\[1\] holds itself"):
        dm.MetricsConfig.from_yaml(itself)


def test_an_override_of_one_aliased_section_changes_that_section_alone(tmp_path):
    """Two features sections written as one YAML anchor and its alias: an override of one section's layers
    changed the other's too where the copy kept them one object."""
    path = tmp_path / "c.yaml"
    path.write_text("tensor_inspect:\n  features:\n    fc1_stats: &feat\n      enabled: true\n      layers:\n"
                    "        layer_name_regex_pattern: .*fc1$\n    fc2_stats: *feat\n")
    features = dm.MetricsConfig.from_yaml(path, [
        "tensor_inspect.features.fc2_stats.layers.layer_name_regex_pattern=.*fc2$"]).tensor_inspect.features
    assert features["fc1_stats"]["layers"]["layer_name_regex_pattern"] == ".*fc1$"
    assert features["fc2_stats"]["layers"]["layer_name_regex_pattern"] == ".*fc2$"


def test_a_numpy_value_of_the_wrong_type_is_named_by_its_numpy_type():
    """np.bool_ given for a bool key read "json_log=np.True_ has type bool; accepted: bool"."""
    import numpy as np

    with pytest.raises(ConfigError, match=r"^json_log=np.True_ has type numpy.bool_?; accepted: bool$"):
        dm.MetricsConfig(json_log=np.bool_(True))
    with pytest.raises(ConfigError, match=r"^log_interval=np.int64\(3\) has type numpy.int64; accepted: int"):
        dm.MetricsConfig(log_interval=np.int64(3))


def test_an_inline_features_error_is_led_by_the_override_that_gave_the_features():
    """check-config blamed the config file (which held no tensor_inspect) for an error in inline features an
    override set: the '<inline features>:' lead named no key."""
    from distmetrics.overrides import source_of

    message = "<inline features>: section 'a': freq must be a whole number of steps >= 1, got 0"
    given = ["tensor_inspect.enabled=true", "tensor_inspect.features={a: {enabled: true}}"]
    assert source_of(message, given, Path("plain.yaml")) == f"override {given[1]!r}: {message}"
    assert source_of(message, given[:1], Path("plain.yaml")) == f"plain.yaml: {message}"  # the file's features
    deeper = ["tensor_inspect.features.a.distmetrics.LogTensorStats.freq=0"]  # one key inside the file's features
    assert source_of(message, deeper, Path("plain.yaml")) == f"override {deeper[0]!r}: {message}"


def test_unknown_keyword_argument_is_a_config_error_with_the_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'log_intervall' \(value 5\); did you mean 'log_interval'\?"):
        dm.MetricsConfig(log_intervall=5)
    with pytest.raises(ConfigError, match=r"'tensor_inspect\.enabld'.*did you mean 'tensor_inspect\.enabled'\?"):
        dm.TensorInspectConfig(enabld=True)


def test_unknown_nested_key_is_named_with_its_section():
    with pytest.raises(ConfigError, match=r"unknown config key 'tensor_inspect\.enabld'.*did you mean 'tensor_inspect\.enabled'\?"):
        dm.MetricsConfig.from_dict({"tensor_inspect": {"enabld": True}})
    with pytest.raises(ConfigError, match=r"override 'tensor_inspect\.enabld=true': unknown config key "
                                          r"'tensor_inspect\.enabld'.*did you mean 'tensor_inspect\.enabled'\?"):
        dm.MetricsConfig.from_dict({}, ["tensor_inspect.enabld=true"])


def test_unknown_key_inside_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("log_interval: 5\ntensor_inspect:\n  enabld: true\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown config key 'tensor_inspect\.enabld'"):
        dm.MetricsConfig.from_yaml(path)
    path.write_text("log_intervall: 5\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: .*did you mean 'log_interval'"):
        dm.MetricsConfig.from_yaml(path, ["writer_rank=last"])


def test_a_bad_value_names_where_it_came_from_the_file_or_the_override(tmp_path):
    """A value that is not accepted is named with its source: the file's path when the file set
    it, the override (the last one that set the key or its section) when one did; a mapping with
    no file names the override alone."""
    path = tmp_path / "mine.yaml"
    path.write_text("log_interval: 0\nwandb_mode: off\n")
    file = re.escape(str(path))
    with pytest.raises(ConfigError, match=rf"^{file}: wandb_mode=False: YAML reads"):
        dm.MetricsConfig.from_yaml(path, ["log_interval=2"])
    with pytest.raises(ConfigError, match=rf"^{file}: log_interval=0: accepted values are integers >= 1"):
        dm.MetricsConfig.from_yaml(path, ["wandb_mode=disabled"])
    path.write_text("log_interval: 5\n")
    with pytest.raises(ConfigError, match=r"^override 'log_interval=abc': log_interval='abc' has type str"):
        dm.MetricsConfig.from_yaml(path, ["log_interval=4", "log_interval=abc"])
    with pytest.raises(ConfigError, match=r"^override 'log_interval=0': log_interval=0: accepted"):
        dm.MetricsConfig.from_dict({"log_interval": 5}, ["log_interval=0"])
    with pytest.raises(ConfigError, match=r"^override 'tensor_inspect=\{init_training_step: -1\}': "
                                          r"tensor_inspect\.init_training_step=-1: accepted"):
        dm.MetricsConfig.from_yaml(path, ["tensor_inspect={init_training_step: -1}"])
    with pytest.raises(ConfigError, match=r"^log_interval=0: accepted"):  # no file, no override: the key alone
        dm.MetricsConfig.from_dict({"log_interval": 0}, ["writer_rank=last"])


def test_numbers_in_exponent_form_are_floats_in_files_and_overrides(tmp_path):
    """PyYAML follows YAML 1.1, which reads ``1e9`` (no dot, no exponent sign) as text; where a key
    takes a number, config files and overrides read it as YAML 1.2 does, and keys that take text
    keep it as written. A whole number where an int belongs is refused with the int to write."""
    path = tmp_path / "model.yaml"
    path.write_text("num_params: 7e10\nnum_layers: 32\nhidden_size: 4096\nseq_length: 4096\n"
                    "peak_tflops: .989e3\nsol_step_time_ms: 1.5E+3\n")
    cfg = dm.MetricsConfig.from_yaml(path, ["num_active_params=13e9"])
    assert (cfg.num_params, cfg.peak_tflops, cfg.sol_step_time_ms, cfg.num_active_params) == (7e10, 989.0, 1500.0,
                                                                                              13e9)
    assert cfg.resolved_flops_per_token == 6 * 13e9 + 6 * 32 * 4096 * 4096  # a causal mask: half of 12·L·h·s
    with pytest.raises(ConfigError, match=r"^override 'total_steps=1e5': total_steps=100000\.0 has type float; "
                                          r"accepted: int or None; write 100000$"):
        dm.MetricsConfig.from_yaml(path, ["total_steps=1e5"])
    text = dm.MetricsConfig.from_yaml(path, ["output_dir=1e3", "wandb_exp_name=2025e1"])  # keys that take text
    assert (text.output_dir, text.wandb_exp_name) == ("1e3", "2025e1")


def test_bad_writer_rank_lists_the_accepted_values():
    with pytest.raises(ValueError, match=r"^writer_rank='middle': accepted values are 'first', 'last'$"):
        dm.MetricsConfig(writer_rank="middle")
    with pytest.raises(ValueError, match=r"writer_rank='frist'.*did you mean 'first'\?"):
        dm.MetricsConfig.from_dict({}, ["writer_rank=frist"])


def test_yaml_boolean_for_a_word_says_so_and_suggests_disabled():
    """``wandb_mode=off`` reaches the config as False (YAML 1.1 booleans)."""
    with pytest.raises(ConfigError, match=r"wandb_mode=False: YAML reads an unquoted off/on/no/yes as a boolean.*"
                                          r"'online', 'offline', 'disabled'; for False write the word disabled"):
        dm.MetricsConfig.from_dict({}, ["wandb_mode=off"])


def test_yaml_boolean_for_text_says_so_and_how_to_quote_the_word(tmp_path):
    """``wandb_project=off`` reached the config as False and was refused only as "has type bool; accepted:
    str or None", without saying that YAML read the word as a boolean. Quoted, the word is the text."""
    with pytest.raises(ConfigError, match=re.escape(
            "override 'wandb_project=off': wandb_project=False: YAML reads an unquoted off/on/no/yes as a boolean, "
            "not a word; accepted: str or None; for the word, quote it: wandb_project: 'off' in a file, "
            "wandb_project=\"'off'\" as an override")):
        dm.MetricsConfig.from_dict({}, ["wandb_project=off"])
    path = tmp_path / "metrics.yaml"
    path.write_text("wandb_exp_name: yes\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: wandb_exp_name=True: YAML reads an unquoted "
                                                    "off/on/no/yes as a boolean, not a word; accepted: str or None; "
                                                    "for the word, quote it as written: wandb_exp_name: '<word>' in "
                                                    "a file")):
        dm.MetricsConfig.from_yaml(path)
    path.write_text("wandb_exp_name: 'yes'\n")
    assert dm.MetricsConfig.from_yaml(path, ["wandb_project='off'"]).to_dict()["wandb_project"] == "off"
    assert dm.MetricsConfig.from_yaml(path).wandb_exp_name == "yes"


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


def test_from_dict_leaves_the_mapping_it_was_given_as_it_was():
    """An override of a nested key was written into the caller's own section, so a sweep's next config
    from the same base mapping carried it; and a config held the caller's features mapping, so an
    override for a later config changed an earlier one, already checked."""
    import copy

    features = {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                        "LogTensorStats": {"enabled": True, "stats": ["min"], "tensors": ["activation"]}}}
    base = {"log_interval": 5, "tensor_inspect": {"init_training_step": 0, "features": features}}
    before = copy.deepcopy(base)
    first = dm.MetricsConfig.from_dict(base, ["tensor_inspect.init_training_step=1000",
                                              "tensor_inspect.features.sec.enabled=false", "log_interval=7"])
    assert first.tensor_inspect.init_training_step == 1000 and first.log_interval == 7
    assert base == before
    second = dm.MetricsConfig.from_dict(base)
    assert second.tensor_inspect.init_training_step == 0 and second.tensor_inspect.features["sec"]["enabled"]
    dm.MetricsConfig.from_dict(base, ["tensor_inspect.features.sec.enabled=false"])
    assert second.tensor_inspect.features["sec"]["enabled"] and base == before
    section = dm.TensorInspectConfig(features=features)  # a section given as a config object: copied too
    built = dm.MetricsConfig.from_dict({"tensor_inspect": section})
    assert built.tensor_inspect is not section and built.tensor_inspect.features is not features
    with pytest.raises(ConfigError, match="log_interval=.* has type generator; accepted: int"):  # not copied first
        dm.MetricsConfig.from_dict({"log_interval": (x for x in range(3))})


def test_missing_and_broken_yaml_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        dm.MetricsConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("log_interval: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        dm.MetricsConfig.from_yaml(bad)


def test_monitor_rejects_a_bad_config_before_any_collective():
    # No process group exists here: a config error must come first, from the constructor.
    with pytest.raises(ValueError, match="log_interval=0"):
        dm.Monitor({"log_interval": 0})


def test_a_yaml_syntax_error_in_an_override_is_a_config_error():
    with pytest.raises(ConfigError, match=r"override 'log_interval=\[1': the value '\[1' is not valid YAML"):
        dm.MetricsConfig.from_dict({}, ["log_interval=[1"])


def test_a_binary_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "metrics.yaml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"metrics\.yaml' is not a UTF-8 text file"):
        dm.MetricsConfig.from_yaml(path)


@pytest.mark.parametrize("key,value", [("total_steps", 2 ** 63), ("log_interval", 10 ** 30)],
                         ids=["total_steps=2**63", "log_interval=10**30"])
def test_numbers_that_do_not_fit_are_refused_at_construction(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}=.*: accepted values are finite numbers below 2\*\*63"):
        dm.MetricsConfig(**{key: value})


FLOAT_KEYS = {"spike_factor": "finite numbers > 1",
              "hang_timeout_s": "numbers from 0 to 1e9",
              "straggler_threshold": "numbers in (0, 1]",
              "flops_per_token": "None or numbers > 0 up to 1e30",
              "peak_tflops": "None or finite numbers >= 1e-9 (train/mfu_pct stays finite)",
              "num_params": "None or finite numbers > 0",
              "num_active_params": "None or finite numbers > 0",
              "sol_step_time_ms": "None or numbers > 0 up to 1e12"}
"""Every float key, and the start of what it accepts."""


@pytest.mark.parametrize("value,text", [(math.inf, ".inf"), (-math.inf, "-.inf"), (math.nan, ".nan"),
                                        (10 ** 400, "1e400")], ids=["inf", "-inf", "nan", "10**400"])
@pytest.mark.parametrize("key", sorted(FLOAT_KEYS))
def test_a_float_key_refuses_inf_nan_and_numbers_beyond_a_float_naming_what_it_accepts(key, value, text):
    """They were refused as 'finite numbers below 2**63', which a float key is not held to (1e20 is
    accepted): the message says what the key accepts, given as a keyword or as an override."""
    assert {f.name for f in dataclasses.fields(dm.MetricsConfig) if f.type in ("float", "Optional[float]")} == set(
        FLOAT_KEYS)
    given = {"num_params": 1e9} if key == "num_active_params" else {}
    accepted = re.escape(FLOAT_KEYS[key])
    with pytest.raises(ConfigError, match=rf"^{key}=[^:]+: accepted values are {accepted}"):
        dm.MetricsConfig(**given, **{key: value})
    with pytest.raises(ConfigError, match=rf"^override '{key}={re.escape(text)}': {key}=-?(inf|nan): accepted values "
                                          rf"are {accepted}"):
        dm.MetricsConfig.from_dict(given, [f"{key}={text}"])
    plain = text.replace(".", "") if "." in text else None  # as a command line writes it: text to YAML
    if plain is not None:
        with pytest.raises(ConfigError, match=rf"^override '{key}={plain}': {key}={plain}: accepted values "
                                              rf"are {accepted}"):
            dm.MetricsConfig.from_dict(given, [f"{key}={plain}"])


@pytest.mark.parametrize("key,value,accepted", [
    ("flops_per_token", 1e308, "None or numbers > 0 up to 1e30"),
    ("flops_per_token", 1.0000001e30, "None or numbers > 0 up to 1e30"),
    ("num_params", 1e308, "model descriptions whose FLOPs per token (6·N + the attention term) are at most 1e30"),
    ("num_params", 1e30, "model descriptions whose FLOPs per token (6·N + the attention term) are at most 1e30"),
    ("sol_step_time_ms", 1e308, "None or numbers > 0 up to 1e12"),
])
def test_a_value_whose_derived_metrics_overflow_to_inf_is_refused(key, value, accepted):
    """flops_per_token=1e308 made train/tflops_per_gpu, train/mfu_pct and the checkpoints' FLOP count
    inf at the first log step; sol_step_time_ms=1e308 made train/sol_pct inf."""
    message = rf"^{key}={re.escape(repr(value))}: accepted values are {re.escape(accepted)}"
    with pytest.raises(ConfigError, match=message):
        dm.MetricsConfig(**{key: value})


def test_large_finite_values_whose_metrics_stay_finite_are_accepted():
    from distmetrics.config import MAX_FLOPS_PER_TOKEN, MAX_SOL_STEP_TIME_MS

    for given in (dict(flops_per_token=1e12), dict(flops_per_token=10 ** 20), dict(flops_per_token=1e30),
                  dict(num_params=1e15, num_layers=2 ** 20, hidden_size=2 ** 20, seq_length=2 ** 20),
                  dict(sol_step_time_ms=1e12), dict(spike_factor=1e308), dict(peak_tflops=1e-9)):
        config = dm.MetricsConfig(**given)
        assert all(getattr(config, key) == value for key, value in given.items())
    tokens, seconds = 2.0 ** 63, 1e-9  # a count beyond any interval's, over a nanosecond
    assert math.isfinite(tokens * MAX_FLOPS_PER_TOKEN / seconds / 1e12)  # TFLOP/s, as the throughput computes it
    assert math.isfinite(100.0 * MAX_SOL_STEP_TIME_MS / (seconds * 1000.0))  # train/sol_pct
    assert math.isfinite(100.0 * tokens * MAX_FLOPS_PER_TOKEN / seconds / 1e12 / 1e-9)  # train/mfu_pct, least peak
    with pytest.raises(ConfigError, match=r"^peak_tflops=1e-300: accepted values are None or finite numbers >= 1e-9"):
        dm.MetricsConfig(peak_tflops=1e-300)


@pytest.mark.parametrize("keys,message", [
    (dict(num_params=7e9, hidden_size=4096, seq_length=4096),
     r"^hidden_size=4096, seq_length=4096 without num_layers: the attention term of flops_per_token \(L·h·s\)"),
    (dict(num_params=7e9, num_layers=32), r"^num_layers=32 without hidden_size and seq_length"),
    (dict(num_active_params=1e9), r"^num_active_params=1000000000\.0 without num_params: a model description"),
    (dict(num_layers=2, hidden_size=8, seq_length=16), r"^num_layers=2, hidden_size=8, seq_length=16 without num_params"),
    (dict(num_params=1e9, num_active_params=2e9),  # it gave 6 * 2e9, more than the whole model
     r"^num_active_params=2000000000\.0: accepted values are at most num_params \(1000000000\.0\)"),
], ids=["no num_layers", "num_layers alone", "active without num_params", "attention without num_params",
        "more active than all"])
def test_a_partial_model_description_is_refused_not_left_out_of_mfu(keys, message):
    """Before, a missing attention field dropped 12·L·h·s without a word (MFU about 13% low for a
    7B model at 4k) and num_active_params alone gave no FLOPs at all. A whole one is accepted."""
    with pytest.raises(ConfigError, match=message):
        dm.MetricsConfig(**keys)
    whole = dm.MetricsConfig(num_params=7e9, num_layers=32, hidden_size=4096, seq_length=4096, num_active_params=1e9)
    assert whole.resolved_flops_per_token == 6 * 1e9 + 6 * 32 * 4096 * 4096
    assert dm.MetricsConfig(num_params=7e9).resolved_flops_per_token == 6 * 7e9  # 6·N alone
    if keys.get("num_active_params", 0) > keys.get("num_params", math.inf):  # refused beside flops_per_token too,
        with pytest.raises(ConfigError, match=message):  # as the README says (it was accepted there)
            dm.MetricsConfig(flops_per_token=5e10, **keys)
        return
    given = dm.MetricsConfig(flops_per_token=5e10, **keys)  # flops_per_token given: the description is not used
    assert given.resolved_flops_per_token == 5e10


def test_a_hang_timeout_beyond_what_the_store_can_wait_is_refused_naming_the_key():
    """Above about 8.6e13 s the store's timeout overflowed inside the first wait, which then
    reported a hang at Monitor() on every rank; 1e9 s (31 years) is the largest accepted."""
    with pytest.raises(ConfigError, match=r"^hang_timeout_s=1e\+16: accepted values are numbers from 0 to 1e9"):
        dm.MetricsConfig(hang_timeout_s=1e16)
    assert dm.MetricsConfig(hang_timeout_s=1e9).hang_timeout_s == 1e9


@pytest.mark.parametrize("text,message", [
    ("log_interval: 010\n", "line 1: the number '010' has a leading 0: YAML 1.1 reads it as octal"),
    ("console: false\nlog_interval: 1:30\n", "line 2: '1:30' is a number in base 60 to YAML 1.1 (1:30 is 90)"),
    ("log_interval: 08\n", "line 1: the number '08' has a leading 0: YAML 1.1 reads it as text, YAML 1.2 as decimal"),
    ("log_interval: 1_000\n", "line 1: the number '1_000' holds a '_': YAML 1.1 reads it as 1000, YAML 1.2 as text; "
                              "write it without the '_', or quote the text"),
    ("console: false\npeak_tflops: 989_000.5\n", "line 2: the number '989_000.5' holds a '_': YAML 1.1 reads it as "
                                                 "989000.5, YAML 1.2 as text"),
    ("log_interval: 0o10\n", "line 1: the number '0o10' is octal to YAML 1.2 (8), text to YAML 1.1; write the number "
                             "in decimal, or quote the text"),
    ("console: false\n1: 2\n", "line 2: the key '1' is not text (int): config keys are names"),
    ("tensor_inspect:\n  enabled: false\n  3.5: x\n", "line 3: the key '3.5' is not text (float)"),
    ("log_interval: 10\nconsole: false\nlog_interval: 20\n", "key 'log_interval' is given twice in one mapping "
                                                              "(lines 1 and 3)")])
def test_what_yaml_would_read_silently_otherwise_is_refused(tmp_path, text, message):
    """log_interval: 010 became 8 (YAML 1.1's octal); a key given twice kept its last value; 08
    (text to YAML 1.1) and a key that is not text were refused without the file's line."""
    import distmetrics as dm

    path = tmp_path / "metrics.yaml"
    path.write_text(text)
    with pytest.raises(dm.ConfigError, match=re.escape(message)):
        dm.MetricsConfig.from_yaml(path)
    with pytest.raises(dm.ConfigError, match="leading 0") as raised:
        dm.MetricsConfig.from_dict({}, ["log_interval=010"])
    assert "quote it" not in str(raised.value)  # quoted, '010' is text where an int belongs: the fix is the 0
    with pytest.raises(dm.ConfigError, match="write it without the leading 0"):  # 08: not octal, so text to YAML 1.1
        dm.MetricsConfig.from_dict({}, ["log_interval=08"])
    assert dm.MetricsConfig.from_dict({}, ["log_interval=0x10"]).log_interval == 16
    merged = tmp_path / "merged.yaml"  # YAML's merge key, and a key it brings given again: both as PyYAML reads them
    merged.write_text("<<: {tensorboard: false, log_interval: 5}\nlog_interval: 7\n")
    config = dm.MetricsConfig.from_yaml(merged)
    assert (config.tensorboard, config.log_interval) == (False, 7)


def test_numbers_yaml_1_1_and_1_2_read_differently_are_refused_in_overrides_and_kept_as_text_quoted(tmp_path):
    """log_interval=1_000 became 1000 without a word (YAML 1.2 reads text), and 0o10 (8 to YAML 1.2) was
    refused only as "has type str". Quoted, both are text where text belongs."""
    with pytest.raises(ConfigError, match=re.escape("override 'log_interval=1_000': the number '1_000' holds a '_': "
                                                    "YAML 1.1 reads it as 1000, YAML 1.2 as text")):
        dm.MetricsConfig.from_dict({}, ["log_interval=1_000"])
    with pytest.raises(ConfigError, match=re.escape("override 'log_interval=0o10': the number '0o10' is octal to "
                                                    "YAML 1.2 (8), text to YAML 1.1")):
        dm.MetricsConfig.from_dict({}, ["log_interval=0o10"])
    path = tmp_path / "metrics.yaml"
    path.write_text("wandb_exp_name: '1_000'\nwandb_project: \"0o10\"\nlog_interval: 1000\n")
    config = dm.MetricsConfig.from_yaml(path)
    assert (config.wandb_exp_name, config.wandb_project, config.log_interval) == ("1_000", "0o10", 1000)


def test_overrides_given_as_one_string_and_keys_that_are_not_text_are_named(tmp_path):
    """from_yaml(p, "timing_log_level=1") iterated the string: "override 't' is not of the form
    key=value"; from_dict({1: 2}) raised TypeError: keywords must be strings."""
    import distmetrics as dm

    with pytest.raises(dm.ConfigError, match=r"overrides are a list of 'key=value' strings, got the string "
                                             r"'timing_log_level=1': pass \['timing_log_level=1'\]"):
        dm.MetricsConfig.from_dict({}, "timing_log_level=1")
    with pytest.raises(dm.ConfigError, match="1: config keys are names"):
        dm.MetricsConfig.from_dict({1: 2})


def test_an_error_two_keys_make_names_the_override_that_set_either():
    """enabled=true from an override with the file's features unset was blamed on the file."""
    import distmetrics as dm
    from tests.dist_utils import ROOT

    with pytest.raises(dm.ConfigError, match=r"^override 'tensor_inspect.enabled=true': tensor_inspect.features=None"):
        dm.MetricsConfig.from_yaml(ROOT / "configs" / "metrics.yaml", ["tensor_inspect.enabled=true"])


def test_a_config_file_not_found_by_a_relative_path_names_the_working_directory(tmp_path, monkeypatch):
    """The quickstart's configs/metrics.yaml run from outside the checkout: the message named the
    path alone."""
    import distmetrics as dm

    monkeypatch.chdir(tmp_path)
    where = re.escape(str(tmp_path))
    with pytest.raises(dm.ConfigError, match=f"does not exist \\(relative to the working directory {where}\\)"):
        dm.MetricsConfig.from_yaml("configs/metrics.yaml")


def test_a_misspelt_key_set_on_a_config_after_it_was_made_is_refused_at_once(tmp_path):
    """``config.log_intervall = 2`` made an attribute no one read: the Monitor logged every 10 steps,
    without a word."""
    config = dm.MetricsConfig(output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'log_intervall' (value 2); did you mean "
                                                    "'log_interval'?")):
        config.log_intervall = 2
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'tensor_inspect.enabeld' (value True); did "
                                                    "you mean 'tensor_inspect.enabled'?")):
        config.tensor_inspect.enabeld = True
    config.log_interval = 2  # a field: set, and checked by the Monitor
    assert not hasattr(config, "log_intervall") and config.log_interval == 2


@pytest.mark.parametrize("key,value,message", [
    ("log_interval", 0, "log_interval=0: accepted values are integers >= 1"),
    ("log_interval", 2.5, "log_interval=2.5 has type float; accepted: int"),
    ("writer_rank", "middle", "writer_rank='middle': accepted values are 'first', 'last'"),
    ("output_dir", "", "output_dir='': accepted values are a non-empty path"),
])
def test_a_config_changed_after_it_was_made_is_checked_by_the_monitor(tmp_path, key, value, message):
    """A field set on a MetricsConfig after it was made was not checked: log_interval 0 failed at the
    first step with a ZeroDivisionError, 2.5 ran, writer_rank 'middle' was taken for 'last' and an
    empty output_dir wrote into the working directory. The Monitor keeps a checked copy."""
    import distmetrics as dm

    config = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False)
    setattr(config, key, value)
    with pytest.raises(dm.ConfigError, match=re.escape(message)):
        dm.Monitor(config)
    config = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=2)
    with dm.Monitor(config) as monitor:
        config.log_interval = 1  # too late: the Monitor keeps its copy
        assert monitor.step(1) is None and monitor.config.log_interval == 2


@pytest.mark.parametrize("key,value,unset", [
    ("output_dir", "  ", None),
    ("tensorboard_dir", "", "the default, {output_dir}/tensorboard"),
    ("wandb_project", "", "no W&B"),
    ("wandb_exp_name", "", "W&B names the run"),
    ("wandb_entity", " ", "W&B's default entity"),
    ("wandb_save_dir", "", "the default, {output_dir}"),
])
def test_a_blank_path_or_name_is_refused_naming_the_key_and_none_keeps_its_meaning(key, value, unset):
    """wandb_project="" turned W&B off, wandb_save_dir="" and tensorboard_dir="" fell back to the
    defaults, and output_dir="  " wrote into a folder named by two spaces, all without a word."""
    accepted = "a non-empty path (not only spaces)" if unset is None else f"None ({unset}) or text that is not blank"
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r}: accepted values are {accepted}")):
        dm.MetricsConfig(**{key: value})
    with pytest.raises(ConfigError, match=re.escape(f"override {f'{key}={value!r}'!r}: {key}={value!r}")):
        dm.MetricsConfig.from_dict({}, [f"{key}={value!r}"])  # quoted: '{key}=' alone is YAML's null, None
    if unset is not None:  # README: `wandb_project=` (a shell's `wandb_project=""`) is null
        assert getattr(dm.MetricsConfig.from_dict({}, [f"{key}="]), key) is None
        config = dm.MetricsConfig(**{key: None}, wandb_mode="offline")
        assert getattr(config, key) is None
        assert config.resolved_tensorboard_dir == "runs/default/tensorboard"


def test_a_path_holding_a_nul_character_is_refused_naming_the_key(tmp_path, capsys):
    """check-config said ok and Monitor() failed on the writer alone with a bare ``ValueError: embedded
    null byte`` naming no key, the other ranks waiting (tensorboard_dir: after the start-up gather)."""
    message = "a path holds no NUL character ('\\x00'); accepted values are paths without one"
    for section, key, value in (("", "output_dir", "runs/a\0b"), ("", "tensorboard_dir", "tb\0"),
                                ("", "wandb_save_dir", "\0"), ("tensor_inspect.", "log_dir", "x\0"),
                                ("tensor_inspect.", "features", "f\0.yaml"),
                                ("tensor_inspect.", "feature_dirs", ["ok", "a\0"])):
        given = {key: value} if not section else {"tensor_inspect": {key: value}}
        with pytest.raises(ConfigError, match=re.escape(f"{section}{key}={value!r}: {message}")):
            dm.MetricsConfig(**given)
    config = dm.MetricsConfig(output_dir=str(tmp_path))
    config.output_dir = f"{tmp_path}/a\0b"  # set after construction: checked by the Monitor
    with pytest.raises(ConfigError, match=re.escape(message)):
        dm.Monitor(config)
    from distmetrics.cli import main  # check-config, with the value in a file

    path = tmp_path / "nul.yaml"
    path.write_text('output_dir: "runs/a\\0b"\n')  # YAML's escape of NUL in a double-quoted string
    capsys.readouterr()
    assert main(["check-config", str(path)]) == 2
    assert f"output_dir={'runs/a' + chr(0) + 'b'!r}: {message}" in capsys.readouterr().err


def test_a_blank_tensor_inspect_log_dir_is_refused_and_none_keeps_the_default(tmp_path):
    """tensor_inspect.log_dir="  " made nvdlfw-inspect's log folder a folder named by two spaces;
    like the other text keys whose None means something, a blank one is refused naming the key."""
    accepted = "accepted values are None (the default, {output_dir}/tensor_inspect) or text that is not blank"
    for value in ("", "  "):
        with pytest.raises(ConfigError, match=re.escape(f"tensor_inspect.log_dir={value!r}: {accepted}")):
            dm.MetricsConfig(tensor_inspect={"log_dir": value})
        with pytest.raises(ConfigError, match=re.escape(f"tensor_inspect.log_dir={value!r}: {accepted}")):
            dm.TensorInspectConfig(log_dir=value)
        override = f"tensor_inspect.log_dir={value!r}"
        with pytest.raises(ConfigError, match=re.escape(f"override {override!r}: tensor_inspect.log_dir={value!r}")):
            dm.MetricsConfig.from_dict({}, [override])
    assert dm.MetricsConfig.from_dict({}, ["tensor_inspect.log_dir="]).tensor_inspect.log_dir is None
    assert dm.MetricsConfig(tensor_inspect={"log_dir": str(tmp_path)}).tensor_inspect.log_dir == str(tmp_path)


def test_a_tensor_inspect_section_with_every_key_commented_out_names_what_is_accepted(tmp_path):
    """A `tensor_inspect:` line whose keys were all commented out said "tensor_inspect=None has type
    NoneType; accepted: TensorInspectConfig", a class name the YAML's writer never sees."""
    path = tmp_path / "metrics.yaml"
    path.write_text("log_interval: 5\ntensor_inspect:\n  # enabled: true\n  # features: configs/x.yaml\n")
    accepted = ("accepted values are a mapping of tensor_inspect keys (enabled, features, feature_dirs, "
                "allow_custom_feature_dirs, log_dir, init_training_step; in Python a TensorInspectConfig too), "
                "or leave the key out for no tensor inspection")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: tensor_inspect=None (a `tensor_inspect:` line whose "
                                                    f"keys are all commented out reads as None): {accepted}")):
        dm.MetricsConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=re.escape(f"override 'tensor_inspect=5': tensor_inspect=5: {accepted}")):
        dm.MetricsConfig.from_dict({}, ["tensor_inspect=5"])
    path.write_text("log_interval: 5\n")  # the key left out, or an empty mapping: no tensor inspection
    assert dm.MetricsConfig.from_yaml(path).tensor_inspect == dm.TensorInspectConfig()
    assert dm.MetricsConfig(tensor_inspect={}).tensor_inspect.enabled is False


def _jobs_whose_output_dirs_differ_after_a_hash(rank, world, root):
    """Every rank: the unquoted override refused, then two jobs (``#1``, ``#2``) with the quoted one."""
    out = {}
    try:
        dm.MetricsConfig.from_dict({}, [f"output_dir={root}/exp #1"])
    except ConfigError as err:
        out["refused"] = str(err)
    for job in (1, 2):
        keys = dict(log_interval=1, console=False, tensorboard=False, log_progress=False, straggler_window=0)
        with dm.Monitor(dm.MetricsConfig.from_dict(keys, [f"output_dir='{root}/exp #{job}'"])) as monitor:
            monitor.step(1, loss=float(job))
    return out


def test_an_override_holding_a_comment_is_refused_on_every_rank_and_quoted_keeps_jobs_apart(tmp_path):
    """output_dir=runs/exp #1 was read as 'runs/exp' (YAML's comment), so the jobs #1 and #2 wrote into one
    folder. Each rank refuses it before any collective, naming the key and how to quote it; quoted, each job
    writes its own folder. A file's comment is still a comment."""
    results = run_ranks(_jobs_whose_output_dirs_differ_after_a_hash, 2, str(tmp_path), timeout=120)
    item = f"output_dir={tmp_path}/exp #1"
    expected = (f"override {item!r}: YAML reads '#1' as a comment and drops it from the value; a command line means "
                f"no comment; to pass the text, quote it inside the value: output_dir=\"'{tmp_path}/exp #1'\"")
    assert [r.get("refused") for r in results] == [expected, expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp #1", "exp #2"]
    for job in (1, 2):
        losses = [r["train/loss"] for r in dm.read_jsonl(tmp_path / f"exp #{job}" / "metrics.jsonl")
                  if r["kind"] == "train"]
        assert losses == [float(job)]
    with pytest.raises(ConfigError, match=re.escape("override 'wandb_exp_name=lr 3e-4 #2': YAML reads '#2' as a")):
        dm.MetricsConfig.from_dict({}, ["wandb_exp_name=lr 3e-4 #2"])
    assert dm.MetricsConfig.from_dict({}, ["output_dir=a#b"]).output_dir == "a#b"  # no space before '#': text
    path = tmp_path / "metrics.yaml"
    path.write_text("output_dir: runs/a  # where\nwandb_exp_name: 'lr #2'\n")
    config = dm.MetricsConfig.from_yaml(path)
    assert (config.output_dir, config.wandb_exp_name) == ("runs/a", "lr #2")


_ANCHOR_ON_NOTHING = "is a YAML anchor on no value, which YAML reads as null: quote it"


@pytest.mark.parametrize("item,message,in_file", [
    ("wandb_project=None", "'None' is text to YAML, not null: write null for unset, or quote it ('None') for the text",
     "'None' is text to YAML, not null"),
    ("output_dir=none", "'none' is text to YAML, not null", "'none' is text to YAML, not null"),
    ("wandb_project=&team", "'&team' is a YAML anchor (a name for the value after it; with none after it, null); an "
                            "override takes no anchor, alias or tag; to pass the text, quote it inside the value: "
                            "wandb_project=\"'&team'\"", f"'&team' {_ANCHOR_ON_NOTHING} ('&team') for the text"),
    ("tensorboard_dir=&x", "'&x' is a YAML anchor", f"'&x' {_ANCHOR_ON_NOTHING}"),
    ("total_steps=&x", "'&x' is a YAML anchor", f"'&x' {_ANCHOR_ON_NOTHING}"),
    ("wandb_project=*team", "'*team' is a YAML alias", None),  # in a file, an alias of no anchor is a YAML error
    ("wandb_project=!!null x", "'!!null' is a YAML tag (it sets what the value after it is read as)",
     "the tag !!null makes 'x' null: leave the tag out for the text, or write null for unset"),
])
def test_none_anchors_aliases_and_tags_are_refused_not_read_as_text_or_null(tmp_path, item, message, in_file):
    """wandb_project=None was the text 'None' (W&B on, a project named None), output_dir=None a folder
    named None; &team, &x and !!null x were null (W&B off, total_steps unset). In a file the bare None
    and the ones read as null are refused with the line; null, ~ and a quoted word keep their meaning."""
    with pytest.raises(ConfigError, match=re.escape(f"override {item!r}: {message}")):
        dm.MetricsConfig.from_dict({}, [item])
    key, value = item.split("=", 1)
    path = tmp_path / "metrics.yaml"
    path.write_text(f"log_interval: 5\n{key}: {value}\n")
    if in_file is not None:
        with pytest.raises(ConfigError, match=re.escape(f"{path}', line 2: {in_file}")):
            dm.MetricsConfig.from_yaml(path)
    assert dm.MetricsConfig.from_dict({}, ["wandb_project='None'", "wandb_exp_name='&team'"]).to_dict()[
        "wandb_exp_name"] == "&team"
    for unset in ("wandb_project=null", "wandb_project=~", "wandb_project="):
        assert dm.MetricsConfig.from_dict({"wandb_project": "p"}, [unset]).wandb_project is None
    path.write_text("wandb_save_dir: &d runs/x\ntensorboard_dir: *d\nwandb_exp_name: !!str 5\n")
    config = dm.MetricsConfig.from_yaml(path)  # anchors and tags that name a value stay YAML's
    assert (config.wandb_save_dir, config.tensorboard_dir, config.wandb_exp_name) == ("runs/x", "runs/x", "5")


@pytest.mark.parametrize("written,read", [("yes", "True"), ("on", "True"), ("NO", "False"), ("123", "123"),
                                          ("0x10", "16"), ("1.50", "1.5")])
def test_a_boolean_or_number_given_to_text_says_to_quote_the_word_written(tmp_path, written, read):
    """wandb_exp_name=yes was told to quote 'on' (the word rebuilt from True), and =123 was refused as
    "has type int" with no hint. An override's hint quotes what was written; a file's, read by YAML
    already, says it generically, as a keyword argument's does."""
    word = "word" if read in ("True", "False") else "text"
    with pytest.raises(ConfigError, match=re.escape(
            f"override 'wandb_exp_name={written}': wandb_exp_name={read}: YAML reads an unquoted ") + ".*" + re.escape(
            f"; accepted: str or None; for the {word}, quote it: wandb_exp_name: '{written}' in a file, "
            f"wandb_exp_name=\"'{written}'\" as an override")):
        dm.MetricsConfig.from_dict({}, [f"wandb_exp_name={written}"])
    generic = re.escape(f"for the {word}, quote it as written: wandb_exp_name: '<{word}>' in a file")
    path = tmp_path / "metrics.yaml"
    path.write_text(f"wandb_exp_name: {written}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: wandb_exp_name={read}: .*{generic}"):
        dm.MetricsConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=generic):
        dm.MetricsConfig(wandb_exp_name=yaml.safe_load(written))
    assert dm.MetricsConfig.from_dict({}, [f"wandb_exp_name='{written}'"]).wandb_exp_name == written


def test_binary_numbers_and_underscored_exponents_are_refused_and_a_date_is_text(tmp_path):
    """log_interval=0b11 was 3 (YAML 1.1's binary; text to YAML 1.2) and num_params=7_000e6 was 7e9 while
    1_000 was refused; output_dir=2024-01-01 was refused as "has type date" with no hint: a date is text,
    as YAML 1.2 reads it. An int given to a float key is a float (10**21 as 1e21)."""
    path = tmp_path / "metrics.yaml"
    cases = {"log_interval=0b11": "the number '0b11' is binary to YAML 1.1 (3), text to YAML 1.2; write the number "
                                  "in decimal, or quote the text",
             "num_params=7_000e6": "num_params='7_000e6': the number holds a '_', which makes it text to YAML; "
                                   "write it without the '_' (7000e6)"}
    for item, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(f"override {item!r}: {message}")):
            dm.MetricsConfig.from_dict({}, [item])
        path.write_text(item.replace("=", ": ") + "\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            dm.MetricsConfig.from_yaml(path)
    path.write_text("output_dir: 2024-01-01\nnum_params: 7000e6\n")
    config = dm.MetricsConfig.from_yaml(path, ["wandb_exp_name=2024-01-01 10:00:00"])
    assert (config.output_dir, config.num_params, config.wandb_exp_name) == ("2024-01-01", 7e9, "2024-01-01 10:00:00")
    with pytest.raises(ConfigError, match=re.escape("log_interval='2024-01-01' has type str; accepted: int")):
        dm.MetricsConfig.from_dict({}, ["log_interval=2024-01-01"])
    path.write_text(f"num_params: {10 ** 21}\n")
    for config in (dm.MetricsConfig(num_params=10 ** 21), dm.MetricsConfig.from_dict({}, [f"num_params={10 ** 21}"]),
                   dm.MetricsConfig.from_yaml(path)):
        assert type(config.num_params) is float and config.num_params == 1e21
    assert repr(dm.MetricsConfig(spike_factor=5, total_steps=5).spike_factor) == "5.0"  # an int key keeps its int
    assert type(dm.MetricsConfig(spike_factor=5, total_steps=5).total_steps) is int
    with pytest.raises(ConfigError, match=r"^spike_factor=1: accepted values are finite numbers > 1$"):
        dm.MetricsConfig(spike_factor=1)  # as given, not as stored


@pytest.mark.parametrize("key,given,meant", [("timing_log_option", "MAX", "max"), ("writer_rank", "LAST", "last"),
                                             ("update_norm_snapshot", "CPU", "cpu"), ("wandb_mode", "Offline",
                                                                                      "offline")])
def test_a_choice_in_other_letter_case_is_told_the_choice_meant(tmp_path, key, given, meant):
    """timing_log_option=Max got "did you mean 'max'?", MAX, LAST and CPU no hint at all."""
    message = re.escape(f"{key}={given!r}: accepted values are ") + rf".*; did you mean {meant!r}\?$"
    path = tmp_path / "metrics.yaml"
    path.write_text(f"{key}: {given}\n")
    for build in (lambda: dm.MetricsConfig(**{key: given}), lambda: dm.MetricsConfig.from_yaml(path),
                  lambda: dm.MetricsConfig.from_dict({}, [f"{key}={given}"])):
        with pytest.raises(ConfigError, match=message):
            build()


def test_a_monitor_given_a_path_points_to_from_yaml():
    with pytest.raises(TypeError, match=re.escape("config must be a MetricsConfig or a mapping, got str; for a YAML "
                                                  "file, pass MetricsConfig.from_yaml('configs/x.yaml')")):
        dm.Monitor("configs/x.yaml")


def test_a_features_file_is_read_as_nvdlfw_inspect_reads_it_where_a_metrics_config_refuses(tmp_path):
    """A bare None, an anchor on no value and !!null are refused in a metrics config (each reads as
    something else than it looks) but not in a features file, which nvdlfw-inspect reads with
    yaml.safe_load: the same mapping as it reads."""
    import yaml

    from distmetrics.yamlfile import ConfigLoader, read_yaml

    path = tmp_path / "features.yaml"
    for text in ("s:\n  note: None\n", "s:\n  end: &end\n  again: *end\n", "s: [none, 1]\n"):
        path.write_text(text)
        assert read_yaml(path, "features file") == yaml.safe_load(text), text
        with pytest.raises(ConfigError):
            read_yaml(path, loader=ConfigLoader)


def test_a_yaml_path_that_is_no_regular_file_is_named_as_such():
    """/dev/null given as the features file or config was said not to exist."""
    from pathlib import Path

    from distmetrics.config import ConfigError
    from distmetrics.yamlfile import read_yaml

    with pytest.raises(ConfigError, match=r"features file '/dev/null' is not a regular file; give the YAML file"):
        read_yaml(Path("/dev/null"), "features file")


def test_path_keys_take_path_objects_as_their_text(tmp_path):
    """``output_dir=pathlib.Path(...)`` was refused ("has type PosixPath; accepted: str"), though a path is
    what the key names. A path object is its text in every path key (``feature_dirs``' items too), set on
    the config after it was made as well; a bytes path is still refused."""
    import distmetrics as dm

    features = tmp_path / "features.yaml"
    inspect = dict(enabled=True, features=features, feature_dirs=[tmp_path / "f"], log_dir=tmp_path / "ti")
    config = dm.MetricsConfig(output_dir=tmp_path / "run", tensorboard_dir=tmp_path / "tb",
                              wandb_save_dir=tmp_path / "wb", tensor_inspect=inspect)
    assert (config.output_dir, config.tensorboard_dir, config.wandb_save_dir) == (
        str(tmp_path / "run"), str(tmp_path / "tb"), str(tmp_path / "wb"))
    ti = config.tensor_inspect
    assert (ti.features, ti.feature_dirs, ti.log_dir) == (str(features), [str(tmp_path / "f")], str(tmp_path / "ti"))
    with pytest.raises(ConfigError, match=r"^output_dir=b'/tmp' has type bytes; accepted: str$"):
        dm.MetricsConfig(output_dir=b"/tmp")
    config = dm.MetricsConfig(console=False, tensorboard=False, log_interval=1)
    config.output_dir = tmp_path / "later"
    with dm.Monitor(config) as monitor:
        monitor.step(1, loss=2.0)
    assert [r["train/loss"] for r in dm.read_jsonl(tmp_path / "later" / "metrics.jsonl") if "train/loss" in r] == [2.0]


def test_overrides_given_as_any_iterable_are_read_once_and_name_themselves():
    """A generator of overrides failed with ``TypeError: 'generator' object is not reversible`` where
    one of them was refused (the error looked for the override that set the value)."""
    path = ROOT / "configs" / "metrics.yaml"
    with pytest.raises(ConfigError, match=re.escape("override 'log_interval=0': log_interval=0: accepted values")):
        dm.MetricsConfig.from_yaml(path, (item for item in ["log_interval=0"]))
    assert dm.MetricsConfig.from_yaml(path, iter(["log_interval=3"])).log_interval == 3
    assert dm.MetricsConfig.from_dict({}, ("log_interval=4",)).log_interval == 4
    with pytest.raises(ConfigError, match="overrides are a list of 'key=value' strings, got 5"):
        dm.MetricsConfig.from_yaml(path, 5)
    with pytest.raises(ConfigError, match="in order, got a set"):  # two of one key would win by the hash seed
        dm.MetricsConfig.from_yaml(path, {"log_interval=3", "log_interval=4"})
