"""Configuration: one dataclass tree, from keyword arguments or YAML.

Field names follow Megatron's ``LoggerConfig`` where the meaning is the same, so a Megatron
user recognises them. Every field is checked at construction: an unknown key, a wrong type or
an impossible value raises ``ValueError`` (:class:`ConfigError`) naming the key, the value
given and what is accepted, before any collective is issued, so no rank can hang on a typo.
Keyword arguments, mapping keys, ``key=value`` overrides and YAML files are checked alike
(:mod:`distmetrics.validation`); the config is torch-free, so the command line reads it fast.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from .flops import model_flops_per_token
from .overrides import apply_overrides, exponent_numbers, source_of
from .redaction import redact_mapping
from .validation import (ConfigError, check_file_keys, check_types, checked_keywords, floats_of_ints, non_text_key,
                         paths_as_text, paths_without_nul)
from .yamlfile import ConfigLoader, read_yaml

__all__ = ["MetricsConfig", "TensorInspectConfig", "ConfigError", "parse_overrides", "read_yaml",
           "MAX_STRAGGLER_WINDOW", "MAX_FLOPS_PER_TOKEN", "MAX_SOL_STEP_TIME_MS"]

MAX_STRAGGLER_WINDOW = 100
"""The longest straggler window: a median over 100 log steps already shrugs off 49 slow intervals, an
alert waits a whole window (100 log steps of 100 steps: 10,000 steps), and every log step takes each
series' median over the window again: 37–66 ms at 1,024 ranks and 20 series with 100 (README, Stragglers)."""

MAX_FLOPS_PER_TOKEN, MAX_SOL_STEP_TIME_MS = 1e30, 1e12
"""The most FLOPs per token (given or derived: 1.7e29 parameters at 6·N, beyond any model) and the longest
speed-of-light step time (31 years) accepted: TFLOP/s, the checkpoints' FLOP counts and ``train/sol_pct``,
computed from them, stay finite (``1e308`` times a token count, or over a step time, is inf)."""
MIN_PEAK_TFLOPS = 1e-9
"""The least peak accepted: ``train/mfu_pct`` over it stays finite (over 1e-300 it was 9e303, below that inf)."""

_ACCEPTED = {
    "spike_factor": "finite numbers > 1",
    "hang_timeout_s": "numbers from 0 to 1e9 (0 turns the check off; a longer wait does not fit the store's timeout)",
    "straggler_threshold": "numbers in (0, 1]",
    "flops_per_token": "None or numbers > 0 up to 1e30 (TFLOP/s and the checkpoints' FLOP counts stay finite)",
    "peak_tflops": "None or finite numbers >= 1e-9 (train/mfu_pct stays finite)",
    "num_params": "None or finite numbers > 0",
    "num_active_params": "None or finite numbers > 0",
    "sol_step_time_ms": "None or numbers > 0 up to 1e12 (about 31 years; train/sol_pct stays finite)",
}
"""What each float key accepts: said for a value out of range, and for inf, nan or a number beyond
float64 (refused by type before the range is checked, so one message says what would be accepted)."""


@checked_keywords("tensor_inspect.")
@dataclass(kw_only=True)
class TensorInspectConfig:
    """Tensor statistics selected by an nvdlfw-inspect features file (mirrors Megatron-Bridge)."""

    enabled: bool = False
    """Turn tensor inspection on."""
    features: Optional[Union[str, dict]] = None
    """Path of a YAML features file, or the same content inline as a mapping."""
    feature_dirs: Optional[list] = None
    """Folders of feature definitions; default: TransformerEngine's when installed, else ours."""
    allow_custom_feature_dirs: bool = False
    """Custom feature folders run code: they are refused unless this is true."""
    log_dir: Optional[str] = None
    """Where nvdlfw-inspect writes its own logs (default: ``{output_dir}/tensor_inspect``)."""
    init_training_step: int = 0
    """The training step the inspector starts counting from (set it when resuming)."""

    def __post_init__(self) -> None:
        paths_as_text(self, ("features", "feature_dirs", "log_dir"))
        check_types(self, "tensor_inspect.")
        paths_without_nul(self, "tensor_inspect.", ("features", "feature_dirs", "log_dir"))
        if self.init_training_step < 0:
            raise ConfigError(
                f"tensor_inspect.init_training_step={self.init_training_step!r}: "
                "accepted values are integers >= 0"
            )
        if isinstance(self.features, str) and not self.features.strip():
            raise ConfigError(f"tensor_inspect.features={self.features!r}: give a features YAML path or an inline "
                              "mapping")
        _refuse_blank(self, "tensor_inspect.", _INSPECT_UNSET_MEANS)
        if self.feature_dirs is not None and not all(isinstance(d, str) and d.strip() for d in self.feature_dirs):
            raise ConfigError(f"tensor_inspect.feature_dirs={self.feature_dirs!r}: accepted values are a list of "
                              "folder paths (text)")
        if self.enabled and self.features is None:
            raise ConfigError(
                "tensor_inspect.features=None while tensor_inspect.enabled=True: "
                "give a features YAML path or an inline mapping"
            )


@checked_keywords("")
@dataclass(kw_only=True)
class MetricsConfig:
    """Everything the monitor does, in one place. Units are in the field names or docs."""

    # --- where and how often -------------------------------------------------------------
    log_interval: int = 10
    """Reduce and write every this many optimizer steps (Megatron's ``log_interval``)."""
    loss_average: Literal["tokens", "steps", "last"] = "tokens"
    """What ``train/loss`` is over a log interval: ``tokens``, its losses weighed by their tokens over
    every step; ``steps``, the plain mean of each step's loss (Megatron's ``lm loss``); ``last``, the
    last step's loss (torchtitan's). Each step's loss is token-weighted across ranks alike."""
    output_dir: str = "runs/default"
    """Folder for ``metrics.jsonl``, ``progress.txt`` and (by default) TensorBoard events."""
    writer_rank: Literal["first", "last"] = "first"
    """Which rank writes: ``first`` (rank 0) or ``last`` (world-1, where Megatron's loss lives)."""
    pipeline_style: Literal["loop", "v"] = "loop"
    """Which pipeline rank holds which stages, as torchtitan names it: ``loop`` (rank r holds
    stages r, r + pp, ...: the last stage, which computes the loss, on the last pipeline rank) or
    ``v`` (rank r holds stages r and 2·pp − 1 − r, as ``ScheduleZBVZeroBubble`` and
    ``ScheduleDualPipeV`` place them: the last stage on pipeline rank 0)."""
    json_log: bool = True
    """Write ``{output_dir}/metrics.jsonl``, one JSON object per record."""
    console: bool = True
    """Write one line per log step through Python ``logging`` (logger ``distmetrics.console``)."""
    verbosity: int = 0
    """Console detail: -1 eval lines and alerts only, 0 one line per log step, 1 adds telemetry."""
    log_progress: bool = True
    """Append Megatron-format lines to ``{output_dir}/progress.txt``."""
    total_steps: Optional[int] = None
    """Planned optimizer steps, for progress percentage and ETA."""

    # --- TensorBoard / W&B ---------------------------------------------------------------
    tensorboard: bool = True
    """Write TensorBoard event files (needs the ``tensorboard`` package)."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard folder; default ``{output_dir}/tensorboard``."""
    wandb_project: Optional[str] = None
    """W&B project; W&B is used only when this is set."""
    wandb_exp_name: Optional[str] = None
    """W&B run name."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user)."""
    wandb_save_dir: Optional[str] = None
    """Folder for W&B files; default ``{output_dir}``."""
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """W&B mode; ``offline`` writes a local run that ``wandb sync`` uploads later; None: W&B's own
    choice (the ``WANDB_MODE`` environment variable, else online), as ``wandb.init`` makes it."""

    hang_timeout_s: float = 300.0
    """Seconds a rank waits at a collective monitor call for the others before raising an error
    that names the ranks that did not arrive and their last calls; 0 turns the check off."""

    # --- timers --------------------------------------------------------------------------
    timing_log_level: int = 0
    """-1 off, 0 iteration time only, 1 coarse timers, 2 fine timers (Megatron's levels)."""
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """How timers are reduced across ranks (Megatron's option names)."""
    log_timers_to_tensorboard: bool = True
    """Send timer values to TensorBoard/W&B too (they always go to JSONL)."""
    barrier_with_L1_time: bool = True
    """Honour ``barrier=True`` passed to timers (a real barrier); false turns those barriers off."""

    # --- norms ---------------------------------------------------------------------------
    log_grad_norm: bool = True
    """Log the total gradient norm (pre-clip) and ``grad_clip_ratio``."""
    log_grad_norm_per_module: bool = True
    """Log ``grad_norm/<module>`` (Megatron's ``log_l2_norm_grad_to_tensorboard``)."""
    module_norm_depth: Optional[int] = None
    """Per-module norms down to this many name levels; None: every module owning parameters."""
    log_params_norm: bool = False
    """Log ``param_norm`` and ``param_norm/<module>`` on log steps."""
    log_update_norm: bool = False
    """Log ``update_norm``, ``relative_update_norm``, ``effective_lr_ratio`` on log steps."""
    update_norm_snapshot: Literal["device", "cpu"] = "device"
    """Where the pre-step copy of local shards lives on log steps."""

    # --- throughput, hardware ------------------------------------------------------------
    log_throughput: bool = True
    """Log tokens/s, step time, TFLOP/s/GPU, MFU and ETA."""
    flops_per_token: Optional[float] = None
    """Training FLOPs per token (forward+backward); enables TFLOP/s and MFU."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one GPU for MFU; default looked up for the detected GPU."""
    dtype: Literal["bf16", "fp16", "tf32", "fp32", "fp8"] = "bf16"
    """Math precision, selecting the peak used for MFU."""
    num_params: Optional[float] = None
    """The whole model's parameters (under pipeline parallelism every stage's, the same on every rank), to
    derive ``flops_per_token`` = 6·N + attention (see ``attention_flops``) when it is not given."""
    num_active_params: Optional[float] = None
    """Parameters active per token (MoE: shared + routed experts); default ``num_params``."""
    num_layers: Optional[int] = None
    """Transformer layers (attention term of the FLOPs formula)."""
    hidden_size: Optional[int] = None
    """Hidden size (attention term of the FLOPs formula)."""
    seq_length: Optional[int] = None
    """Sequence length (attention term of the FLOPs formula)."""
    attention_flops: Literal["causal", "full"] = "causal"
    """The attention term: ``causal`` 6·L·h·s (half of QKᵀ and AV under a causal mask, as
    Megatron-LM counts), ``full`` 12·L·h·s (PaLM's and torchtitan's count)."""
    sol_step_time_ms: Optional[float] = None
    """Speed-of-light time of one step (from a roofline model); gives ``train/sol_pct``."""
    log_memory: bool = True
    """Log host RSS and CUDA memory statistics (max across ranks, with the rank)."""
    log_energy: bool = False
    """Log GPU energy (NVML counters) and power."""
    log_gpu_telemetry: bool = False
    """Log GPU clocks, temperature, utilisation and throttle reasons on log steps."""

    # --- stragglers ----------------------------------------------------------------------
    straggler_window: int = 10
    """Log steps in the sliding window of per-rank straggler scores, at most :data:`MAX_STRAGGLER_WINDOW`;
    0 turns scores off (a job of one rank keeps none: there is no other rank to compare with)."""
    straggler_report_every: int = 10
    """Write a ``stragglers`` record every this many log steps; 0: never."""
    straggler_report_ranks: int = 8
    """Slowest and fastest ranks listed in a ``stragglers`` record."""
    straggler_threshold: float = 0.9
    """A rank whose interval step time, against the fastest rank's in that interval, stays below this at every
    log step of a full window gets one alert (the window's median score is the record's, not the alert's)."""

    # --- health and eval -----------------------------------------------------------------
    spike_factor: float = 5.0
    """A value above this many times its moving average is a spike."""
    log_validation_ppl_to_tensorboard: bool = True
    """Send ``eval/ppl`` = exp(eval loss) to TensorBoard and W&B (JSONL and the console always
    have it), as Megatron's ``--log-validation-ppl-to-tensorboard``."""

    tensor_inspect: TensorInspectConfig = field(default_factory=TensorInspectConfig)
    """Tensor statistics from an nvdlfw-inspect features file."""

    def __post_init__(self) -> None:
        if isinstance(self.tensor_inspect, dict):
            self.tensor_inspect = _build(TensorInspectConfig, self.tensor_inspect, "tensor_inspect.")
        elif not isinstance(self.tensor_inspect, TensorInspectConfig):
            raise ConfigError(_not_a_section(self.tensor_inspect))
        paths_as_text(self, ("output_dir", "tensorboard_dir", "wandb_save_dir"))
        check_types(self, "", _ACCEPTED)
        paths_without_nul(self, "", ("output_dir", "tensorboard_dir", "wandb_save_dir"))
        _require(self, "log_interval", self.log_interval >= 1, "integers >= 1")
        _require(self, "verbosity", self.verbosity in (-1, 0, 1), "-1, 0 or 1")
        _require(self, "timing_log_level", self.timing_log_level in (-1, 0, 1, 2), "-1, 0, 1 or 2")
        _require(self, "total_steps", self.total_steps is None or self.total_steps >= 1,
                 "None or integers >= 1")
        _require(self, "module_norm_depth", self.module_norm_depth is None or self.module_norm_depth >= 1,
                 "None or integers >= 1")
        _require(self, "spike_factor", self.spike_factor > 1.0, _ACCEPTED["spike_factor"])
        _require(self, "hang_timeout_s", 0 <= self.hang_timeout_s <= 1e9, _ACCEPTED["hang_timeout_s"])
        _require(self, "straggler_window", 0 <= self.straggler_window <= MAX_STRAGGLER_WINDOW,
                 f"integers from 0 (off) to {MAX_STRAGGLER_WINDOW}: every log step takes each series' median over "
                 "the window again, at a cost that grows with it (README, Stragglers)")
        _require(self, "straggler_report_every", self.straggler_report_every >= 0, "integers >= 0 (0: off)")
        _require(self, "straggler_report_ranks", self.straggler_report_ranks >= 1, "integers >= 1")
        _require(self, "straggler_threshold", 0.0 < self.straggler_threshold <= 1.0, _ACCEPTED["straggler_threshold"])
        for name in ("flops_per_token", "peak_tflops", "num_params", "num_active_params", "num_layers",
                     "hidden_size", "seq_length", "sol_step_time_ms"):
            value = getattr(self, name)
            _require(self, name, value is None or value > 0, _ACCEPTED.get(name, "None or numbers > 0"))
        _require(self, "flops_per_token", self.flops_per_token is None or self.flops_per_token <= MAX_FLOPS_PER_TOKEN,
                 _ACCEPTED["flops_per_token"])
        _require(self, "peak_tflops", self.peak_tflops is None or self.peak_tflops >= MIN_PEAK_TFLOPS,
                 _ACCEPTED["peak_tflops"])
        sol = self.sol_step_time_ms
        _require(self, "sol_step_time_ms", sol is None or sol <= MAX_SOL_STEP_TIME_MS, _ACCEPTED["sol_step_time_ms"])
        self._check_model_description()
        flops = self.resolved_flops_per_token
        _require(self, "num_params", flops is None or flops <= MAX_FLOPS_PER_TOKEN,
                 "model descriptions whose FLOPs per token (6·N + the attention term) are at most 1e30, "
                 "as flops_per_token's")
        _require(self, "output_dir", bool(self.output_dir.strip()), "a non-empty path (not only spaces)")
        _refuse_blank(self, "", _UNSET_MEANS)
        floats_of_ints(self)

    def _check_model_description(self) -> None:
        """A model description (used where flops_per_token is not given) is whole: the attention
        term needs all of num_layers, hidden_size and seq_length (with one missing it would be left
        out without a word, and MFU read low), and every part needs num_params, which the FLOPs
        start from."""
        if self.num_params is not None and self.num_active_params is not None:  # with flops_per_token too
            _require(self, "num_active_params", self.num_active_params <= self.num_params,
                     f"at most num_params ({self.num_params!r}): the parameters one token uses are some of the model's")
        if self.flops_per_token is not None:
            return
        attention = {name: getattr(self, name) for name in ("num_layers", "hidden_size", "seq_length")}
        given = [f"{name}={value!r}" for name, value in attention.items() if value is not None]
        missing = [name for name, value in attention.items() if value is None]
        if given and missing:
            raise ConfigError(f"{', '.join(given)} without {' and '.join(missing)}: the attention term "
                              "of flops_per_token (L·h·s) needs num_layers, hidden_size and seq_length together; "
                              "give all three, or none for 6·N alone")
        if self.num_params is None:
            parts = given + ([f"num_active_params={self.num_active_params!r}"]
                             if self.num_active_params is not None else [])
            if parts:
                raise ConfigError(f"{', '.join(parts)} without num_params: a model description starts from "
                                  "num_params (flops_per_token = 6·N_active + the attention term); give num_params, "
                                  "or flops_per_token")

    # --- construction --------------------------------------------------------------------
    @classmethod
    def coerce(cls, config: Union["MetricsConfig", dict, None]) -> "MetricsConfig":
        """A checked copy of a MetricsConfig (a field set after it was made, ``log_interval = 0``,
        is checked like the constructor's: it failed at the first step, or ran), the defaults for
        None, or one built from a mapping. The Monitor keeps its copy: later changes to yours do
        not reach it."""
        if config is None:
            return cls()
        if isinstance(config, dict):
            return cls.from_dict(config)
        if not isinstance(config, cls):
            path = isinstance(config, (str, os.PathLike))  # Monitor("configs/x.yaml"): the file is meant
            read = f"; for a YAML file, pass MetricsConfig.from_yaml({str(config)!r})" if path else ""
            raise TypeError(f"config must be a MetricsConfig or a mapping, got {type(config).__name__}{read}")
        return config.replace()

    @classmethod
    def from_dict(cls, values: dict, overrides: Optional[list[str]] = None) -> "MetricsConfig":
        """Build from a mapping (as read from YAML), then apply ``key=value`` overrides. A value
        an override set that is not accepted is named with the override."""
        return cls._from(values, overrides or [], None)

    @classmethod
    def from_yaml(cls, path: Union[str, Path], overrides: Optional[list[str]] = None) -> "MetricsConfig":
        """Read a YAML file of config keys; ``overrides`` are ``key=value`` strings applied after.
        Every error names where the value came from: the file's path, or the override."""
        path = Path(path)
        values = read_yaml(path, loader=ConfigLoader)
        try:
            if values is not None and not isinstance(values, dict):
                raise ConfigError(f"a config file is a mapping of keys to values, got {type(values).__name__}")
            check_file_keys(cls, values, "")
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        return cls._from(values or {}, overrides or [], path)

    @classmethod
    def _from(cls, values: Any, overrides: list[str], path: Optional[Path]) -> "MetricsConfig":
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"metrics config must be a mapping of keys to values, got {type(values).__name__}")
        if isinstance(overrides, (set, frozenset, dict)):  # no order: two of one key would win by chance
            raise ConfigError("overrides are a list of 'key=value' strings, in order, got a "
                              f"{type(overrides).__name__}")
        if not isinstance(overrides, (str, bytes, list)):  # a generator or a tuple: read once, then named from
            try:
                overrides = list(overrides)
            except TypeError:
                raise ConfigError(f"overrides are a list of 'key=value' strings, got {overrides!r:.100}") from None
        # the sections copied: overrides go into nested ones, and the config keeps what it was built from
        try:
            copied = _copy_sections(values)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}" if path is not None else str(err)) from None
        merged = apply_overrides(cls, copied, overrides)
        try:
            return _build(cls, exponent_numbers(cls, merged), "")
        except ConfigError as err:
            raise ConfigError(source_of(str(err), overrides, path)) from None

    def replace(self, **changes: Any) -> "MetricsConfig":
        """A copy with some keys changed (checked like the constructor)."""
        values = self.to_dict()
        values.update(changes)
        return type(self).from_dict(values)

    def to_dict(self, redact: bool = False) -> dict:
        """Plain mapping of every key; ``redact`` hides the values of secret keys and the
        credentials in URLs (:mod:`distmetrics.redaction`)."""
        values = dataclasses.asdict(self)
        return redact_mapping(values) if redact else values

    @property
    def resolved_flops_per_token(self) -> Optional[float]:
        """``flops_per_token``, or the one derived from the model description."""
        if self.flops_per_token is not None or self.num_params is None:
            return self.flops_per_token
        return model_flops_per_token(self.num_params, self.num_layers, self.hidden_size, self.seq_length,
                                     self.num_active_params, self.attention_flops)

    @property
    def resolved_tensorboard_dir(self) -> str:
        """The TensorBoard folder actually used."""
        return self.tensorboard_dir or str(Path(self.output_dir) / "tensorboard")


def parse_overrides(items: list[str]) -> dict:
    """``["a=1", "tensor_inspect.enabled=true"]`` → nested mapping with YAML-typed values (keys checked)."""
    return apply_overrides(MetricsConfig, {}, items)


# --- helpers ----------------------------------------------------------------------------

_UNSET_MEANS = {"tensorboard_dir": "the default, {output_dir}/tensorboard", "wandb_project": "no W&B",
                "wandb_exp_name": "W&B names the run", "wandb_entity": "W&B's default entity",
                "wandb_save_dir": "the default, {output_dir}"}
"""The text keys that may be None, and what None means for each: a blank value is refused rather
than read as None (``wandb_project=""`` turned W&B off, ``wandb_save_dir=""`` wrote to output_dir)."""

_INSPECT_UNSET_MEANS = {"log_dir": "the default, {output_dir}/tensor_inspect"}
"""The same for ``tensor_inspect`` (a blank ``log_dir`` made a folder named by its spaces)."""


def _refuse_blank(obj: Any, prefix: str, unset_means: dict) -> None:
    """Refuse a blank value of a text key whose None means something, naming what None means."""
    for name, unset in unset_means.items():
        value = getattr(obj, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{prefix}{name}={value!r}: accepted values are None ({unset}) or text that is not blank")


def _not_a_section(value: Any) -> str:
    """The message for a ``tensor_inspect`` that is no mapping, in the user's terms."""
    keys = ", ".join(f.name for f in dataclasses.fields(TensorInspectConfig))
    empty = (" (a `tensor_inspect:` line whose keys are all commented out reads as None)" if value is None else "")
    return (f"tensor_inspect={value!r}{empty}: accepted values are a mapping of tensor_inspect keys ({keys}; in "
            "Python a TensorInspectConfig too), or leave the key out for no tensor inspection")


def _build(cls: type, values: dict, prefix: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    keys = [key for key in values if not isinstance(key, str)]
    if keys:
        raise ConfigError(non_text_key(prefix, keys[0]))
    return cls(**values)


def _require(obj: Any, name: str, ok: bool, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={getattr(obj, name)!r}: accepted values are {accepted}")


MAX_CONFIG_ITEMS = 1_000_000
"""The most mappings' and lists' items a config may hold once YAML's aliases are expanded: a 450-byte file of
nested aliases expands to 10**7 (check-config ran for minutes; a few more levels take all memory)."""


def _copy_sections(value: Any, state: Optional[dict] = None, where: str = "") -> Any:
    """``value`` with every mapping, list and section given as a config object in it copied (the values
    themselves are not: one that cannot be copied is refused by the checks, naming its key). A YAML alias's
    mapping or list is copied at each place apart, as written out (an override of one section changes that
    one alone); one holding itself (a recursive alias), or aliases expanding past :data:`MAX_CONFIG_ITEMS`
    items, is refused, naming the key."""
    state = {"items": 0, "open": set()} if state is None else state
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, (dict, list)):
        return value
    if id(value) in state["open"]:
        raise ConfigError(f"{where or 'the config'} holds itself (a recursive YAML alias)")
    state["items"] += len(value)
    if state["items"] > MAX_CONFIG_ITEMS:
        raise ConfigError(f"{where or 'the config'}: its YAML aliases expand the config past {MAX_CONFIG_ITEMS:,} "
                          "items")
    state["open"].add(id(value))  # (value is alive while its items are copied: its id is not reused)
    try:
        if isinstance(value, dict):
            return {key: _copy_sections(item, state, f"{where}.{key}" if where else str(key))
                    for key, item in value.items()}
        return [_copy_sections(item, state, f"{where}[{i}]") for i, item in enumerate(value)]
    finally:
        state["open"].discard(id(value))
