"""Features files: reading and checking a YAML before anything runs, and the feature folders to
load (which steps a file selects: :mod:`~distmetrics.tensor_stats.schedule`).

Errors name the file and the key: a missing or unparsable file, a section without layer
selectors, an unknown namespace, feature or statistic, the TE namespace without TE, a TE logging
feature's unknown key or a schedule that selects no step, custom feature folders without
``allow_custom_feature_dirs``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

from ..config import ConfigError, TensorInspectConfig
from ..yamlfile import read_yaml
from .statistics import SUPPORTED_STATS

__all__ = ["check_inspect_config", "load_features", "feature_dirs_for", "check_custom_dirs", "FEATURES_DIR", "TENSORS",
           "NVDLFW_INSTALL", "nvdlfw_installed", "require_nvdlfw"]

TENSORS = ("activation", "input", "weight", "gradient")
FEATURES_DIR = str(Path(__file__).resolve().parent / "nvdlfw_features")
"""Our nvdlfw-inspect feature folder (the ``distmetrics`` namespace)."""
_SELECTORS = ("layer_numbers", "layer_types", "exact_layer_names", "layer_name_regex_pattern")
_FEATURE_KEYS = {"enabled", "tensors", "tensors_struct", "stats", "freq", "start_step", "end_step", "start_end_list"}
_ENTRY_KEYS = {"tensor", "stats", "freq", "start_step", "end_step", "start_end_list"}
"""The settings of one ``tensors_struct`` entry."""
_SCHEDULE_KEYS = ("freq", "start_step", "end_step", "start_end_list")
"""The keys of a tensor's schedule."""
_BASE_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm")
"""nvdlfw-inspect's own ``LogTensorStats`` statistics."""
NVDLFW_INSTALL = 'pip install nvdlfw-inspect==0.2.2 (the "inspect" extra)'


def nvdlfw_installed() -> bool:
    """Whether nvdlfw-inspect is installed (found, not imported: importing it imports torch)."""
    return importlib.util.find_spec("nvdlfw_inspect") is not None


_NVDLFW_MODULES = ("nvdlfw_inspect.api", "nvdlfw_inspect.base", "nvdlfw_inspect.config_manager",
                   "nvdlfw_inspect.debug_features.generic_feature_api", "nvdlfw_inspect.debug_manager",
                   "nvdlfw_inspect.logging", "nvdlfw_inspect.registry")
"""The modules of nvdlfw-inspect the start, our feature folder and the hooks import."""


def require_nvdlfw(need: str = "tensor_inspect.enabled is true",
                   instead: str = "set tensor_inspect.enabled: false") -> None:
    """A ConfigError naming the package and its extra where tensor inspection is on without
    nvdlfw-inspect, or with one a module of which cannot be imported (a part missing, a dependency
    broken): checked with the features file, before any rank starts it (a bare
    ``ModuleNotFoundError`` from deep inside the start named neither, on that rank alone). Imports
    every module the start imports (none of them sets up logging or other state on import).
    ``need`` says what needs it, ``instead`` the other way out."""
    if not nvdlfw_installed():
        raise ConfigError(f"{need} but nvdlfw-inspect is not installed: {NVDLFW_INSTALL}, or {instead}")
    for module in _NVDLFW_MODULES:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - whatever its import raises is the cause to name
            raise ConfigError(f"{need} but nvdlfw-inspect cannot be imported ({module}: {type(err).__name__}: "
                              f"{err}): {NVDLFW_INSTALL} again, or {instead}") from err


def check_inspect_config(config: TensorInspectConfig,
                         dirs_option: str = "tensor_inspect.feature_dirs") -> tuple[dict, list]:
    """Everything checked of ``tensor_inspect`` before nvdlfw-inspect starts (by the Monitor and
    by ``distmetrics check-config``): custom feature folders allowed and present, the features
    file, the folders to load. Returns the features mapping and those folders. ``dirs_option``
    is how the user gives feature folders, named in errors (``--feature-dir`` on the command line)."""
    # Feature folders of the user's own may register the transformer_engine namespace (an
    # emulation, a fork); they stand in for TE's, and nvdlfw-inspect checks them at start.
    check_custom_dirs(config)
    spec = load_features(config.features, te_available=True if config.feature_dirs else None, dirs_option=dirs_option,
                         init_training_step=config.init_training_step)
    return spec, _feature_dirs(config, spec)


def load_features(spec: Union[str, dict], te_available: Optional[bool] = None,
                  dirs_option: str = "tensor_inspect.feature_dirs", init_training_step: int = 0) -> dict:
    """Read and check a features YAML (path or mapping); returns the mapping. A schedule must
    select a step at or after ``init_training_step``, the job's first iteration."""
    source = spec if isinstance(spec, str) else "<inline features>"
    if isinstance(spec, str):
        if _yaml_like(spec) and not os.path.exists(spec):  # exists(): False for a name too long
            raise ConfigError(f"tensor_inspect.features: {spec[:60] + ('...' if len(spec) > 60 else '')!r} is no "
                              "file and looks like YAML text (a newline, or ': '): a string is read as a "
                              "features file's path, and inline features are a mapping (in a YAML config, the "
                              "sections indented under 'features:'; in Python, a dict such as yaml.safe_load(text))")
        spec = read_yaml(Path(spec), "tensor_inspect.features: file")
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{source}: a features file is a mapping of sections, got {spec!r}")
    if te_available is None:
        te_available = installed_transformer_engine() is not None
    for section, body in spec.items():
        where = f"{source}: section {section!r}"
        if not isinstance(body, dict) or "enabled" not in body:
            raise ConfigError(f"{where} needs 'enabled' and 'layers'")
        _check_enabled(where, body["enabled"])
        layers = body.get("layers")
        if isinstance(layers, dict):  # a typo first: it may be the only key (`layer_name_regex: fc1`)
            _check_known(where, list(layers), _SELECTORS, "layers")
        if not isinstance(layers, dict) or not any(k in layers for k in _SELECTORS):
            raise ConfigError(f"{where}: 'layers' needs one of {', '.join(_SELECTORS)}")
        empty = [k for k in _SELECTORS if k in layers and layers[k] is None]
        if empty:  # `exact_layer_names:` with nothing after it: nvdlfw-inspect said no selector was given
            raise ConfigError(f"{where}: layers.{empty[0]} has no value (YAML null); give it one, or leave the "
                              "key out")
        _check_selectors(where, layers)
        if isinstance(body.get("LogTensorStats"), dict) and isinstance(body.get("distmetrics"), dict) and \
                "LogTensorStats" in body["distmetrics"]:  # both measured by the hooks: every value counted twice
            raise ConfigError(f"{where}: both nvdlfw-inspect's LogTensorStats and distmetrics.LogTensorStats; the "
                              "Monitor's hooks measure both alike, so give the statistics in one of them")
        for key, value in body.items():
            if key in ("enabled", "layers"):
                continue
            if key == "transformer_engine":
                if not te_available:
                    raise ConfigError(f"{where}: key 'transformer_engine' needs TransformerEngine (and a GPU) or "
                                      f"a feature folder given with {dirs_option} that registers that "
                                      "namespace; use the 'distmetrics' namespace for plain PyTorch modules")
                _check_te_features(where, value, init_training_step)
            elif key == "distmetrics":
                _check_our_features(where, value, init_training_step)
            elif key == "LogTensorStats":  # nvdlfw's own base-namespace feature
                _check_feature(where, "LogTensorStats", value, _BASE_STATS, TENSORS, strict=False,
                               first=init_training_step)
            else:
                raise ConfigError(f"{where}: unknown key {key!r}; accepted: 'distmetrics', 'transformer_engine' "
                                  "or nvdlfw's base feature 'LogTensorStats'")
        features = [body["LogTensorStats"]] if "LogTensorStats" in body else []
        features += [cfg for key in ("distmetrics", "transformer_engine") for cfg in (body.get(key) or {}).values()]
        if body["enabled"] and not any(cfg.get("enabled", True) is True for cfg in features if isinstance(cfg, dict)):
            raise ConfigError(f"{where}: the section is enabled and none of its features is, so it would measure "
                              "nothing; enable a feature, or give the section enabled: false")
    if not any(body["enabled"] for body in spec.values()):  # nvdlfw-inspect: "Could not load config from input"
        raise ConfigError(f"{source}: every section has enabled: false, so nothing would be inspected; enable a "
                          "section, or set tensor_inspect.enabled: false")
    return {section: _exact_names_as_pattern(f"{source}: section {section!r}", body) for section, body in spec.items()}


def _check_selectors(where: str, layers: dict) -> None:
    """Known selectors only, a pattern that compiles, layer types as a list, layer numbers as
    nvdlfw-inspect reads them: it ignored an unknown key (``layer_type:``, so the section's other
    selectors chose more layers), raised re.error from inside its start for a bad pattern, read
    ``layer_types: fc1`` letter by letter (``f|c|1``, which selects fc2 too), and failed on
    ``layer_numbers: 1`` with "'int' object is not iterable". Unknown keys are refused before (see
    :func:`_check_known`)."""
    numbers = layers.get("layer_numbers")
    alone = isinstance(numbers, str) and numbers.lower() == "all"  # as nvdlfw-inspect reads it: any case
    if numbers is not None and not (alone or (isinstance(numbers, list) and numbers and all(
            _layer_number(n) for n in numbers))):
        raise ConfigError(f"{where}: layers.layer_numbers must be a list of layer numbers and ranges such as "
                          f"[1, 3, '5-7'] (a range's first number no larger than its last), or 'all'; got {numbers!r}")
    pattern = layers.get("layer_name_regex_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(f"{where}: layers.layer_name_regex_pattern must be a regular expression (text), "
                              f"got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"{where}: layers.layer_name_regex_pattern {pattern!r} is not a regular expression "
                              f"({err})") from None
    types = layers.get("layer_types")
    if types is not None and not _names(types):
        raise ConfigError(f"{where}: layers.layer_types must be a list of names such as [fc1, fc2], got {types!r}")
    ignored = [key for key in ("layer_numbers", "layer_types") if layers.get(key) is not None]
    if pattern is not None and ignored and layers.get("exact_layer_names") is None:
        raise ConfigError(f"{where}: layers.layer_name_regex_pattern selects alone: nvdlfw-inspect ignores "
                          f"{' and '.join(ignored)} beside it, so the section would take every layer the pattern "
                          "matches; put the numbers or types in the pattern, or give them without it")


def _check_known(where: str, keys: list, known: Any, place: str) -> None:
    """Refuse keys that are not in ``known``, each named with the closest known key (a typo,
    ``freqq:`` or ``layer_name_regex:``, was ignored)."""
    unknown = [key for key in keys if key not in known]
    if not unknown:
        return
    close = [(key, difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)) for key in unknown]
    hint = ", ".join(repr(match[0]) if len(unknown) == 1 else f"{match[0]!r} for {key!r}"
                     for key, match in close if match)
    raise ConfigError(f"{where}: unknown key(s) {sorted(unknown, key=str)} in {place}; "
                      f"{f'did you mean {hint}? Accepted' if hint else 'accepted'}: {', '.join(sorted(known))}")


def _layer_number(value: Any) -> bool:
    """A layer number (``3``), an inclusive range (``'5-7'``) or ``'all'``, as nvdlfw-inspect reads them."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    if not isinstance(value, str):
        return False
    span = re.fullmatch(r"(\d+)-(\d+)", value)  # '7-5' selected nothing, without a word
    return value == "all" or (span is not None and int(span[1]) <= int(span[2]))


def _names(value: Any) -> bool:
    """A non-empty list of non-empty names (layer types, exact layer names)."""
    return isinstance(value, list) and bool(value) and all(isinstance(n, str) and n for n in value)


def _exact_names_as_pattern(where: str, body: dict) -> dict:
    """A section selecting ``exact_layer_names`` as the anchored ``layer_name_regex_pattern`` that
    selects the same layers. nvdlfw-inspect 0.2.2 raises ValueError ("Could not find layer using
    exact layer name") for every layer the list leaves out, the root module included, whenever it
    looks a layer up, so the names are handed to it as a pattern; as in nvdlfw-inspect, the list
    takes precedence over the section's other selectors."""
    names = body["layers"].get("exact_layer_names")
    if names is None:
        return body
    given = names
    if isinstance(names, str):
        names = [names]
    if not _names(names):
        raise ConfigError(f"{where}: exact_layer_names must be a list of layer names such as "
                          f"[model.decoder.layers.1.mlp.linear_fc1], got {given!r}")
    pattern = "^(?:" + "|".join(re.escape(n) for n in names) + r")\Z"
    return {**body, "layers": {"layer_name_regex_pattern": pattern}}


def _check_our_features(where: str, features: Any, first: int = 0) -> None:
    if not isinstance(features, dict):
        raise ConfigError(f"{where}: 'distmetrics' must map feature names to settings")
    for name, cfg in features.items():
        if name != "LogTensorStats":
            raise ConfigError(f"{where}: unknown feature 'distmetrics.{name}'; accepted: LogTensorStats")
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: distmetrics.LogTensorStats must be a mapping of settings "
                              f"({', '.join(sorted(_FEATURE_KEYS))}), got {cfg!r}")
        _check_feature(where, "distmetrics.LogTensorStats", cfg, SUPPORTED_STATS, TENSORS, strict=True, first=first)


def _check_te_features(where: str, features: Any, first: int = 0) -> None:
    """TransformerEngine's logging features (``LogTensorStats``, ``LogFp8TensorStats``, any feature
    whose name starts with ``Log``): their keys and schedules as TE reads them (ends included), so a
    typo (``freqq:``) or ``freq: 0`` fails here, not as a ZeroDivisionError naming nothing at the
    first ``monitor.step`` (or, ignored, logs at other steps). Their statistics' names are TE's to
    check, at the first step a feature selects: they vary by TE version and recipe
    (``fp8_current_scaling_underflows%``). TE's other features (``DisableFP8GEMM``,
    ``PerTensorScaling``, ``FakeQuant``, ...) have keys of their own and are left to TE."""
    if not isinstance(features, dict):
        raise ConfigError(f"{where}: 'transformer_engine' must map feature names to settings, got {features!r}")
    for name, cfg in features.items():
        if isinstance(name, str) and name.startswith("Log"):
            _check_feature(where, f"transformer_engine.{name}", cfg, None, (), strict=False, first=first,
                           inclusive=True)


def _check_feature(where: str, feature: str, cfg: dict, supported: Optional[tuple], tensors: tuple, strict: bool,
                   first: int = 0, inclusive: bool = False) -> None:
    """Every tensor entry of a LogTensorStats feature: known keys (a typo, ``freqq:`` or ``stat:``,
    was ignored), a non-empty list of known statistics and a schedule (freq, start_step, end_step,
    start_end_list) of whole steps that selects some step; ``strict`` (ours): known tensors and one
    entry per tensor too (nvdlfw's own takes any tensor name, and a tensor's first entry, as
    nvdlfw-inspect reads it, ignoring the rest). A bad entry fails here, before training, not at the
    first selected step (or, worse, is ignored). ``first``: the job's first iteration
    (``init_training_step``), from which the schedule must select a step. ``supported`` None: any
    statistic's name (TE's, checked by TE); ``inclusive``: TE's schedule convention (see
    :func:`_check_schedule`), where a null start_step, end_step or start_end_list is TE's default."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: {feature} must be a mapping of settings, got {cfg!r}")
    _check_known(where, list(cfg), _FEATURE_KEYS, feature)
    if "enabled" not in cfg:  # nvdlfw-inspect asserts it; without it the feature logged nothing, silently
        raise ConfigError(f"{where}: {feature} needs 'enabled' (true or false)")
    _check_enabled(f"{where}: {feature}", cfg["enabled"])
    seen: set = set()
    for entry in _tensor_entries(where, cfg, feature):
        if "_shared" not in entry:  # a typo (stat: for stats:) would be ignored
            _check_known(where, list(entry), _ENTRY_KEYS, f"a {feature}.tensors_struct entry")
        tensor = entry.get("tensor")
        if tensor is None and "_shared" not in entry:  # nvdlfw's own too: the hooks read entry["tensor"]
            said = "has no value (YAML null)" if "tensor" in entry else "is missing"
            raise ConfigError(f"{where}: the 'tensor' key {said} in the {feature}.tensors_struct entry {entry}; "
                              "give the tensor it measures, such as tensor: activation")
        if tensor is not None and not isinstance(tensor, str):  # a list or mapping: unhashable, a bare TypeError
            raise ConfigError(f"{where}: tensor {tensor!r} in {feature} is not a tensor's name (text, such as "
                              "activation)")
        if strict and tensor not in tensors:
            raise ConfigError(f"{where}: tensor {tensor!r} is not one of {', '.join(tensors)}")
        if strict and isinstance(tensor, str) and tensor in seen:  # nvdlfw's own: its first, as nvdlfw-inspect
            raise ConfigError(f"{where}: tensor {tensor!r} is listed twice in {feature}; nvdlfw-inspect reads its "
                              "first entry only: give its statistics and schedule in one")
        seen.add(tensor)
        stats = entry.get("stats", cfg.get("stats"))
        accepted = ", ".join(supported) if supported else "names TransformerEngine's feature takes, such as max"
        if not isinstance(stats, list) or not stats:
            raise ConfigError(f"{where}: {feature} stats must be a non-empty list of statistics "
                              f"({accepted}) for tensor {tensor!r}, got {stats!r}")
        for stat in stats:  # nvdlfw-inspect's own feature takes any case; ours the names as listed
            if supported is None and not isinstance(stat, (str, dict)):  # TE's: which names, TE says (a dict:
                raise ConfigError(f"{where}: {feature} stat {stat!r} for tensor {tensor!r} is not a statistic's "
                                  "name (text, such as max, or a mapping of one to its settings)")  # its settings)
            if supported is not None and (not isinstance(stat, str) or
                                          (stat if strict else stat.lower()) not in supported):
                raise ConfigError(f"{where}: {feature} stat {stat!r} for tensor {tensor!r} is not one of "
                                  f"{', '.join(supported)}")
        for key in _SCHEDULE_KEYS:  # read as given where the schedule is applied: a TypeError mid-training
            if inclusive and key != "freq":  # TE reads None as its default: start 0, no end, no list
                continue
            if (key in entry and entry[key] is None) or (key not in entry and key in cfg and cfg[key] is None):
                raise ConfigError(f"{where}: {feature} {key} for tensor {tensor!r} has no value (YAML null); give "
                                  "one, or leave the key out")
        _check_schedule(where, feature, tensor, {k: entry.get(k, cfg.get(k)) for k in _SCHEDULE_KEYS}, first,
                        inclusive)


def _check_enabled(where: str, value: Any) -> None:
    """``enabled`` is true or false: nvdlfw-inspect tests it for truth, so the text ``"false"``
    (quoted in YAML) turned a section on."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: enabled must be true or false (unquoted), got {type(value).__name__} {value!r}")


def _check_schedule(where: str, feature: str, tensor: Any, schedule: dict, first: int = 0,
                    inclusive: bool = False) -> None:
    """Whole steps that select some iteration the job runs: nvdlfw-inspect counts iterations from
    ``first`` (``init_training_step``), so a schedule that ends before it logged nothing, silently.
    Read as nvdlfw-inspect reads it (a ``start_end_list`` pair ``[start, end]`` selects start <= step
    < end; -1, as end_step or a pair's end: no end), or, ``inclusive``, as TransformerEngine's
    features do (``next_enabled_iter``: start <= step <= end for end_step and for each pair, no end
    where end_step is left out). TE's -1 depends on its version: no end in those that use
    nvdlfw-inspect's schedule, nothing in those with ``next_enabled_iter``: accepted, read as no end."""
    def whole(value: Any, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    open_end = "end_step -1 or left out: no end" if inclusive else "end_step -1: no end"
    freq = schedule["freq"] if schedule["freq"] is not None else 1
    if not whole(freq, 1):
        raise ConfigError(f"{where}: {feature} for tensor {tensor!r}: freq must be a whole number of steps >= 1, "
                          f"got {freq!r}")
    for key in ("start_step", "end_step"):
        value = schedule[key]
        if value is not None and not whole(value, -1 if key == "end_step" else 0):
            raise ConfigError(f"{where}: {feature} {key} for tensor {tensor!r} must be a whole step number "
                              f"({open_end}), got {value!r}")
    start, end = schedule["start_step"] or 0, schedule["end_step"]
    if end is not None and end != -1 and end < start and not schedule["start_end_list"]:  # a list: both ignored
        raise ConfigError(f"{where}: {feature} end_step {end} for tensor {tensor!r} is before start_step {start}: "
                          f"no step is selected ({open_end})")
    pairs = schedule["start_end_list"]
    reading = "start <= step <= end (both ends included; end -1: no end; start <= end)" if inclusive else \
        "start <= step < end (end -1: no end; start < end)"

    def pair(p: Any) -> bool:  # TE's reading: start <= step <= end; nvdlfw-inspect's: start <= step < end, or -1
        return isinstance(p, list) and len(p) == 2 and whole(p[0], 0) and (
            p[1] == -1 or whole(p[1], p[0] + (not inclusive)))

    if pairs is not None and not (isinstance(pairs, list) and all(pair(p) for p in pairs)):
        raise ConfigError(f"{where}: {feature} start_end_list for tensor {tensor!r} must be a list of "
                          f"[start, end] step pairs, each selecting {reading}, got {pairs!r}")
    # the steps selected are the multiples of freq in the ranges (a multiple of 0: step 0 counts)
    if pairs:
        ranges = [(a, None if b == -1 else b if inclusive else b - 1) for a, b in pairs]
    else:
        ranges = [(start, None if end is None or end == -1 else end)]

    def selects(least: int) -> bool:  # some multiple of freq at or after `least` in a range
        return any(last is None or -(-max(a, least) // freq) * freq <= last for a, last in ranges)

    shown = f"start_end_list {pairs}" if pairs else f"start_step {start} to end_step {end}"
    if not selects(0):
        raise ConfigError(f"{where}: {feature} for tensor {tensor!r} selects no step: no multiple of freq {freq} "
                          f"lies in {shown} (a step is logged where step % freq == 0)")
    if not selects(first):
        raise ConfigError(f"{where}: {feature} for tensor {tensor!r} selects no step of this job: no multiple of "
                          f"freq {freq} in {shown} is at or after tensor_inspect.init_training_step {first}, the "
                          "job's first iteration (iterations count from it)")


def _tensor_entries(where: str, cfg: dict, feature: str = "distmetrics.LogTensorStats") -> list[dict]:
    """A LogTensorStats feature's entries, one per tensor: ``tensors_struct`` (a list of mappings
    with a ``tensor``) or ``tensors`` (a list of names) with the shared settings (marked ``_shared``:
    their keys are the feature's)."""
    struct, tensors = cfg.get("tensors_struct"), cfg.get("tensors")
    if "tensors_struct" in cfg and "tensors" in cfg:  # nvdlfw-inspect reads tensors_struct only (even empty)
        raise ConfigError(f"{where}: {feature} has both 'tensors' and 'tensors_struct'; nvdlfw-inspect reads "
                          "tensors_struct alone: give one of them")
    if struct:
        if not isinstance(struct, list) or not all(isinstance(e, dict) for e in struct):
            raise ConfigError(f"{where}: {feature}.tensors_struct must be a list of mappings "
                              f"such as {{tensor: activation, stats: [max]}}, got {struct!r}")
        return struct
    if tensors is not None and not isinstance(tensors, list):
        raise ConfigError(f"{where}: {feature}.tensors must be a list of tensor names "
                          f"({', '.join(TENSORS)}), got {tensors!r}")
    if not tensors:
        given = next((key for key in ("tensors_struct", "tensors") if key in cfg), None)
        raise ConfigError(f"{where}: {feature}.{given} is empty; list the tensors to measure" if given else
                          f"{where}: {feature} needs 'tensors' or 'tensors_struct'")
    return [dict(cfg, tensor=t, _shared=True) for t in tensors]


def feature_dirs_for(config: TensorInspectConfig, spec: dict) -> list:
    """Our feature namespace, TransformerEngine's when the YAML uses it, and custom folders
    only when ``allow_custom_feature_dirs`` is true (they run code)."""
    check_custom_dirs(config)
    return _feature_dirs(config, spec)


def _feature_dirs(config: TensorInspectConfig, spec: dict) -> list:
    """:func:`feature_dirs_for` once the custom folders are checked."""
    dirs = [FEATURES_DIR]
    te = installed_transformer_engine()
    if te is not None and any("transformer_engine" in body for body in spec.values() if isinstance(body, dict)):
        dirs.append(os.path.join(te, "debug", "features"))
    return dirs + list(config.feature_dirs or [])


def installed_transformer_engine() -> Optional[str]:
    """The folder of an installed TransformerEngine, or None. A ``transformer_engine`` folder that
    is only on the import path — in the working directory, say — is not an installation: its
    feature code is never loaded (it would run before any check)."""
    from importlib import metadata

    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.realpath(list(spec.submodule_search_locations)[0])
    for name in ("transformer_engine", "transformer_engine_torch", "transformer_engine_cu12", "transformer_engine_cu13"):
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        location = os.path.realpath(str(distribution.locate_file("")))
        if folder.startswith(location + os.sep):
            return folder
    return None


def check_custom_dirs(config: TensorInspectConfig) -> None:
    """Custom feature folders run code: refused unless allowed, and each must be a folder."""
    if not config.feature_dirs:
        return
    if not config.allow_custom_feature_dirs:
        raise ConfigError(f"tensor_inspect.feature_dirs={config.feature_dirs!r}: custom feature folders run "
                          "code; set tensor_inspect.allow_custom_feature_dirs: true to allow them")
    for folder in config.feature_dirs:
        if not os.path.isdir(folder):
            raise ConfigError(f"tensor_inspect.feature_dirs: {folder!r} is not a folder")


def _yaml_like(spec: str) -> bool:
    """Whether a string that names no file reads as YAML text rather than a path: a newline, a key
    with its value (``: ``), or a key alone at the end. A path may hold ':' (``C:\\runs``, ``run:7``)."""
    return "\n" in spec or ": " in spec or spec.rstrip().endswith(":")
