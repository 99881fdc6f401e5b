"""Tensor statistics selected by an nvdlfw-inspect features YAML, into every sink.

Two paths, one features file:

* ``distmetrics:`` sections (any PyTorch module, CPU or GPU): module hooks call our feature
  namespace (``distmetrics/inspect_features``) on the steps the YAML selects; it keeps
  on-device partials (n, mean, M2, min, max, Σ|x|, Σx², min |x|>0) merged across micro-batches
  with Chan's pairwise formula. At the end of such a step every rank's partials for every layer
  travel in **one** all-gather (the reducer's ``all`` pack, so pipeline stages holding different
  layers agree on a layout) and are merged pairwise again: the variance is exact, not the
  sign-flipped between-group term of TransformerEngine's cross-rank std.
* ``transformer_engine:`` sections (TE layers on a GPU) and nvdlfw's bare ``base`` features:
  TE computes and reduces these itself and logs them when ``debug_api.step()`` runs; they
  arrive through a :class:`ForwardingLogger` and join the same all-gather on the steps the YAML
  selects (every rank reads that from the YAML, so pipeline stages without selected layers
  join too). A value logged on any other step rides the next log step's MAX pack.

TP/CP peers see the same activations, and data-parallel replicas hold the same weights: only
the rank that represents them contributes, so counts and norms are not multiplied.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml

from ..config import ConfigError
from ..reduce import PerRank, Reducer, Sample

__all__ = ["TensorInspector", "load_features", "accumulate", "SUPPORTED_STATS", "TENSORS"]

logger = logging.getLogger("distmetrics")

SUPPORTED_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
TENSORS = ("activation", "input", "weight", "gradient")
FEATURES_DIR = str(Path(__file__).resolve().parents[1] / "inspect_features")
_PARTS = ("n", "mean", "m2", "min", "max", "l1", "sumsq", "minabs")
_SELECTORS = ("layer_numbers", "layer_types", "exact_layer_names", "layer_name_regex_pattern")
_FEATURE_KEYS = {"enabled", "tensors", "tensors_struct", "stats", "freq", "start_step", "end_step", "start_end_list"}

_TE_TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad", "input")
_FORWARDED = "fwd|"  # reducer names of values logged through nvdlfw-inspect's MetricLogger

_ACTIVE: Optional["TensorInspector"] = None  # the inspector that the feature file reports to


def accumulate(layer: str, tensor_name: str, tensor: torch.Tensor, stats: list) -> None:
    """Called by the feature: merge this tensor's statistics into the step's partials."""
    if _ACTIVE is not None:
        _ACTIVE.add(layer, tensor_name, tensor, stats)


def load_features(spec: Union[str, dict], te_available: Optional[bool] = None) -> dict:
    """Read and check a features YAML (path or mapping) before anything runs.

    Errors name the file and the key: a missing or unparsable file, a section without layer
    selectors, an unknown namespace, feature or statistic, the TE namespace without TE.
    """
    source = spec if isinstance(spec, str) else "<inline features>"
    if isinstance(spec, str):
        if not os.path.isfile(spec):
            raise ConfigError(f"tensor_inspect.features: file {spec!r} does not exist")
        try:
            spec = yaml.safe_load(Path(spec).read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"tensor_inspect.features: {source!r} is not valid YAML: {err}") from None
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{source}: a features file is a mapping of sections, got {spec!r}")
    if te_available is None:
        te_available = importlib.util.find_spec("transformer_engine") is not None
    for section, body in spec.items():
        where = f"{source}: section {section!r}"
        if not isinstance(body, dict) or "enabled" not in body:
            raise ConfigError(f"{where} needs 'enabled' and 'layers'")
        layers = body.get("layers")
        if not isinstance(layers, dict) or not any(k in layers for k in _SELECTORS):
            raise ConfigError(f"{where}: 'layers' needs one of {', '.join(_SELECTORS)}")
        for key, value in body.items():
            if key in ("enabled", "layers"):
                continue
            if key == "transformer_engine":
                if not te_available:
                    raise ConfigError(f"{where}: key 'transformer_engine' needs TransformerEngine (and a GPU) or "
                                      "a feature folder in tensor_inspect.feature_dirs that registers that "
                                      "namespace; use the 'distmetrics' namespace for plain PyTorch modules")
            elif key == "distmetrics":
                _check_our_features(where, value)
            elif key != "LogTensorStats":  # nvdlfw's own base-namespace feature
                raise ConfigError(f"{where}: unknown key {key!r}; accepted: 'distmetrics', 'transformer_engine' "
                                  "or nvdlfw's base feature 'LogTensorStats'")
    return spec


def _check_our_features(where: str, features: Any) -> None:
    if not isinstance(features, dict):
        raise ConfigError(f"{where}: 'distmetrics' must map feature names to settings")
    for name, cfg in features.items():
        if name != "LogTensorStats":
            raise ConfigError(f"{where}: unknown feature 'distmetrics.{name}'; accepted: LogTensorStats")
        unknown = set(cfg) - _FEATURE_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} in distmetrics.LogTensorStats; "
                              f"accepted: {sorted(_FEATURE_KEYS)}")
        entries = cfg.get("tensors_struct") or [dict(cfg, tensor=t) for t in cfg.get("tensors", [])]
        if not entries:
            raise ConfigError(f"{where}: distmetrics.LogTensorStats needs 'tensors' or 'tensors_struct'")
        for entry in entries:
            tensor = entry.get("tensor")
            if tensor not in TENSORS:
                raise ConfigError(f"{where}: tensor {tensor!r} is not one of {', '.join(TENSORS)}")
            for stat in entry.get("stats", cfg.get("stats", [])):
                if stat not in SUPPORTED_STATS:
                    raise ConfigError(f"{where}: stat {stat!r} is not one of {', '.join(SUPPORTED_STATS)}")
            if int(entry.get("freq", cfg.get("freq", 1))) < 1:
                raise ConfigError(f"{where}: freq must be >= 1")


def start_nvdlfw(spec: dict, feature_dirs: list, log_dir: str, statistics_logger: Any = None,
                 init_training_step: int = 0, source: str = "tensor_inspect.features") -> None:
    """``debug_api.initialize`` from a clean slate; its rejection of the features (an
    assertion, or ``SystemExit`` from a feature folder that fails to load) becomes a
    ``ConfigError`` naming ``source`` and the folders, with nothing left running."""
    import nvdlfw_inspect.api as debug_api

    _reset_nvdlfw()
    try:
        debug_api.initialize(config_file=spec, feature_dirs=feature_dirs, statistics_logger=statistics_logger,
                             log_dir=log_dir, init_training_step=init_training_step)
    except (SystemExit, AssertionError, ValueError, TypeError) as err:
        _reset_nvdlfw()
        raise ConfigError(f"{source}: nvdlfw-inspect rejected the features ({err}); feature folders searched: "
                          f"{feature_dirs}") from None


class ForwardingLogger:
    """nvdlfw-inspect statistics logger that hands values to the monitor (TE and base features).

    Built lazily as a ``BaseLogger`` subclass so nvdlfw-inspect stays an optional import."""

    def __new__(cls, inspector: "TensorInspector"):
        from nvdlfw_inspect.logging import BaseLogger

        class _Logger(BaseLogger):
            def log_scalar(self, name, value, iteration, **kwargs):
                inspector.forwarded[inspector.metric_name(name)] = value

        return _Logger()


class TensorInspector:
    """Runs nvdlfw-inspect for one model: names, hooks, per-step reduction, forwarding."""

    def __init__(self, spec: dict, model: Optional[torch.nn.Module], layout: Any, log_dir: str,
                 init_training_step: int, feature_dirs: Optional[list], group: Any = None) -> None:
        global _ACTIVE
        import nvdlfw_inspect.api as debug_api

        self.debug_api = debug_api
        self.spec = spec
        self.forwarded: dict[str, Any] = {}
        self.partials: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.requested: dict[tuple[str, str], list] = {}
        self.reducer = Reducer(group)
        self.iteration = init_training_step
        self._hooks: list = []
        self._models: list = []
        self.layer_names: set[str] = set()
        os.makedirs(log_dir, exist_ok=True)
        start_nvdlfw(spec, feature_dirs, log_dir, ForwardingLogger(self), init_training_step)
        self.set_layout(layout)
        _ACTIVE = self
        self.selected: dict[str, list[str]] = {}
        if model is not None:
            try:
                self.attach(model)
            except Exception:
                self.close()  # end_debug and handlers: the next initialize starts clean
                raise
        self.active = self._stats_step(self.iteration, own_only=True)

    def set_layout(self, layout: Any) -> None:
        """TE's features reduce over nvdlfw-inspect's tensor reduction group: the data-parallel
        peers (pipeline stages and tensor-parallel ranks hold different layers or shards)."""
        from ..parallel import data_parallel_group

        self.layout = layout
        group = data_parallel_group(layout)
        if group is not None:
            self.debug_api.set_tensor_reduction_group(group)

    # --- model ---------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Name the layers (``model.<path>``) and hook the ones our sections select.

        Every enabled section must select a layer on *some* rank (under pipeline parallelism a
        stage may hold none of them): one small all-reduce decides, so a bad selector — or a
        layer two sections target — raises on every rank together instead of leaving the
        others waiting."""
        from nvdlfw_inspect.config_manager import ConfigManager, is_layer_in_cfg

        if any(m is model for m in self._models):
            return  # initialize(config, model=...) then Monitor(config, model=...): hooks once
        self._models.append(model)
        self.debug_api.infer_and_assign_layer_names(model)
        modules = [(m, m.name) for m in model.modules() if isinstance(getattr(m, "name", None), str)]
        self.layer_names.update(name for _, name in modules)
        sections = [name for name, body in self.spec.items() if body.get("enabled")]
        specs = list(ConfigManager.configs)  # nvdlfw keeps the enabled sections in file order
        matched = [any(is_layer_in_cfg(name, spec) for _, name in modules) for spec in specs]
        error = None
        for module, name in modules:
            try:
                cfg = ConfigManager.get_config_for_layer(name)
            except ValueError as err:  # two sections target one layer
                error = f"tensor_inspect.features: {err}"
                break
            if cfg:
                self.selected[name] = list(cfg)
            ours = cfg.get("distmetrics", {}).get("LogTensorStats")
            if ours and ours.get("enabled", False):
                tensors = [e["tensor"] for e in ours.get("tensors_struct", [])] or list(ours.get("tensors", []))
                self._hook(module, name, tensors)
        flags = self._any_rank(matched + [error is not None])
        if flags[-1]:
            raise ConfigError(error or "tensor_inspect.features: another rank's layers were rejected (see its error)")
        unmatched = [section for section, hit in zip(sections, flags[:-1]) if not hit]
        if unmatched:
            raise ConfigError(f"tensor_inspect.features: section(s) {unmatched} select no layer of the model on any "
                              f"rank (layer names look like {_example_names(model)})")

    def _any_rank(self, flags: list) -> list:
        """Element-wise OR of ``flags`` over the reducer's ranks (one all-reduce)."""
        if not self.reducer.distributed:
            return [bool(f) for f in flags]
        packed = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64, device=self.reducer.device)
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=self.reducer.group)
        return [bool(v) for v in packed.tolist()]

    def _hook(self, module: torch.nn.Module, name: str, tensors: list) -> None:
        api = self.debug_api

        def call(tensor_name: str, tensor: torch.Tensor) -> None:
            api.distmetrics.log_tensor_stats(name, tensor_name=tensor_name, tensor=tensor, iteration=self.iteration)

        def forward_hook(mod, inputs, output):
            if not self.active:
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            if "activation" in tensors and isinstance(out, torch.Tensor):
                call("activation", out)
            if "input" in tensors and inputs and isinstance(inputs[0], torch.Tensor):
                call("input", inputs[0])
            if "weight" in tensors and isinstance(getattr(mod, "weight", None), torch.Tensor) \
                    and (name, "weight") not in self.partials:  # once per step, not per micro-batch
                call("weight", mod.weight)
            if "gradient" in tensors and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: call("gradient", grad))

        self._hooks.append(module.register_forward_hook(forward_hook))

    def metric_name(self, logged: str) -> str:
        """Our name for a value logged as ``<layer>_<tensor>_<stat>``."""
        return _metric_name(logged, self.layer_names)

    # --- accumulation (called through the feature) ----------------------------------------
    def add(self, layer: str, tensor_name: str, tensor: torch.Tensor, stats: list) -> None:
        if tensor_name == "weight" and not self._counts_weights():
            return  # a replica of a weight another rank reports
        if tensor_name != "weight" and not self._counts_activations():
            return  # a tensor-/context-parallel peer: the same activations as its rank 0
        x = tensor.detach()
        x = x.to_local() if hasattr(x, "to_local") else x
        x = x.reshape(-1).to(torch.float64)
        if x.numel() == 0:
            return
        mean = x.mean()
        magnitude = x.abs()
        # torch.where/amin and full(): no boolean-mask indexing or host scalar copy, so the
        # host never waits for the device inside a hook (the step's one wait is at end_step).
        batch = {"n": torch.full((), float(x.numel()), dtype=torch.float64, device=x.device), "mean": mean,
                 "m2": (x - mean).pow(2).sum(), "min": x.min(), "max": x.max(), "l1": magnitude.sum(),
                 "sumsq": x.pow(2).sum(),
                 "minabs": torch.where(x != 0, magnitude, torch.full_like(magnitude, math.inf)).amin()}
        key = (layer, tensor_name)
        self.requested[key] = list(stats)
        self.partials[key] = batch if key not in self.partials else merge(self.partials[key], batch)

    def _counts_activations(self) -> bool:
        return self.layout.tp_rank == 0 and self.layout.cp_rank == 0

    def _counts_weights(self) -> bool:
        return self._counts_activations() and getattr(self.layout, "dp_rank", 0) == 0

    # --- per step ------------------------------------------------------------------------
    def end_step(self) -> Optional[dict]:
        """After a training step: reduce this step's statistics (every rank, one collective on
        steps the YAML selects, none otherwise); returns ``tensor_stats/...`` metrics."""
        gather = self._stats_step(self.iteration)
        # TE's features log (and reduce among themselves) inside step(): run it first so their
        # values of this step travel with ours.
        self.debug_api.step()
        metrics = None
        if gather:
            samples = []
            for (layer, tensor_name), parts in self.partials.items():
                stats = ",".join(self.requested[(layer, tensor_name)])
                for part in _PARTS:
                    samples.append(Sample(f"{layer}|{tensor_name}|{stats}|{part}", parts[part], "all"))
            samples += [Sample(f"{_FORWARDED}{name}", value, "all") for name, value in self.forwarded.items()]
            metrics = self._combine(self.reducer.reduce(samples).per_rank)
            self.partials = {}
            self.forwarded = {}
        self.iteration += 1
        self.active = self._stats_step(self.iteration, own_only=True)
        return metrics

    def take_forwarded(self) -> list[Sample]:
        """Values logged outside the YAML's stats steps (e.g. a user's own
        ``debug_api.log_tensor_stats`` call), for the log step's MAX pack."""
        out = [Sample(name, value, "max") for name, value in self.forwarded.items()]
        self.forwarded = {}
        return out

    @staticmethod
    def finalize(metrics: dict) -> None:
        """Forwarded values travel as 'max' from the one rank that logged them: drop the rank."""
        for key in [k for k in metrics if k.startswith("tensor_stats/") and k.endswith("/max_rank")]:
            del metrics[key]

    def close(self) -> None:
        global _ACTIVE
        for hook in self._hooks:
            hook.remove()
        self.debug_api.end_debug()
        _reset_nvdlfw()
        if _ACTIVE is self:
            _ACTIVE = None

    def _stats_step(self, iteration: int, own_only: bool = False) -> bool:
        """Does any enabled feature log at this iteration? Read from the YAML alone, so every
        rank (also one holding none of the selected layers) agrees. ``own_only``: only our
        namespace (whose hooks must fire)."""
        for body in self.spec.values():
            if not body.get("enabled"):
                continue
            features = [("distmetrics", (body.get("distmetrics") or {}).get("LogTensorStats"))]
            if not own_only:
                features.append(("base", body.get("LogTensorStats")))
                features += [("transformer_engine", cfg) for cfg in (body.get("transformer_engine") or {}).values()]
            for namespace, cfg in features:
                if not isinstance(cfg, dict) or not cfg.get("enabled"):
                    continue
                for entry in cfg.get("tensors_struct") or [cfg]:
                    if _logs_at(namespace, dict(cfg, **entry), iteration):
                        return True
        return False

    @staticmethod
    def _combine(per_rank: dict[str, PerRank]) -> dict:
        groups: dict[tuple, dict[str, list]] = {}
        out = {}
        for name, values in per_rank.items():
            if name.startswith(_FORWARDED):
                # Reduced by TE over its group already; where ranks still differ (weights, which
                # TE reports per rank; tensor-parallel shards) the lowest rank's value is written.
                out[name[len(_FORWARDED):]] = values.present()[0]
                continue
            layer, tensor_name, stats, part = name.split("|")
            groups.setdefault((layer, tensor_name, stats), {})[part] = values
        for (layer, tensor_name, stats), parts in sorted(groups.items()):
            merged = None
            for rank in range(len(parts["n"])):
                if parts["n"][rank] is None:
                    continue
                one = {p: torch.tensor(parts[p][rank], dtype=torch.float64) for p in _PARTS}
                merged = one if merged is None else merge(merged, one)
            if merged is None:
                continue
            values = {k: float(v) for k, v in merged.items()}
            prefix = f"tensor_stats/{_strip_model(layer)}/{tensor_name}"
            for stat in stats.split(","):
                out[f"{prefix}/{stat}"] = _stat(stat, values)
        return out


def merge(a: dict, b: dict) -> dict:
    """Chan et al.'s pairwise combination of (n, mean, M2) plus extremes and sums."""
    n = a["n"] + b["n"]
    delta = b["mean"] - a["mean"]
    return {"n": n, "mean": a["mean"] + delta * b["n"] / n,
            "m2": a["m2"] + b["m2"] + delta * delta * a["n"] * b["n"] / n,
            "min": torch.minimum(a["min"], b["min"]), "max": torch.maximum(a["max"], b["max"]),
            "l1": a["l1"] + b["l1"], "sumsq": a["sumsq"] + b["sumsq"],
            "minabs": torch.minimum(a["minabs"], b["minabs"])}


def _stat(stat: str, v: dict) -> float:
    amax = max(abs(v["min"]), abs(v["max"]))
    if stat == "std":
        return math.sqrt(v["m2"] / (v["n"] - 1)) if v["n"] > 1 else math.nan  # torch.std's correction
    if stat == "l2_norm":
        return math.sqrt(v["sumsq"])
    if stat == "l1_norm":
        return v["l1"]
    if stat == "cur_amax":
        return amax
    if stat == "dynamic_range":
        return math.log2(amax) - math.log2(v["minabs"]) if amax > 0 and math.isfinite(v["minabs"]) else 0.0
    return v[stat]  # min, max, mean


def _metric_name(name: str, layers: Any = ()) -> str:
    """TE's ``<layer>_<tensor>_<stat>`` → ``tensor_stats/<layer>/<tensor>/<stat>``.

    The longest known layer name that prefixes ``name`` wins, so a layer whose own name holds
    ``_weight_`` or ``_input_`` is not split there; without a known layer, the last
    ``_<tensor>_`` (stat names hold none)."""
    for layer in sorted(layers, key=len, reverse=True):
        if name.startswith(layer + "_"):
            tensor_name, _, stat = name[len(layer) + 1:].partition("_")
            if stat:
                return f"tensor_stats/{_strip_model(layer)}/{tensor_name}/{stat}"
    hits = [(name.rfind(f"_{t}_"), t) for t in _TE_TENSORS if f"_{t}_" in name]
    if hits:
        at, tensor_name = max(hits)
        return f"tensor_stats/{_strip_model(name[:at])}/{tensor_name}/{name[at + len(tensor_name) + 2:]}"
    return f"tensor_stats/{name}"


def _logs_at(namespace: str, cfg: dict, iteration: int) -> bool:
    """A feature entry's freq/start_step/end_step/start_end_list at ``iteration``, with the
    namespace's own convention (TE's ends are inclusive, nvdlfw's end_step -1 is open)."""
    freq = int(cfg.get("freq", 1))
    if namespace == "transformer_engine":
        intervals = cfg.get("start_end_list") or [(cfg.get("start_step") or 0,
                                                   math.inf if cfg.get("end_step") is None else cfg["end_step"])]
        return iteration % freq == 0 and any(s <= iteration <= e for s, e in intervals)
    from nvdlfw_inspect.logging import enable_logging_at_current_step

    return enable_logging_at_current_step(iteration, freq, cfg.get("start_step", 0), cfg.get("end_step", -1),
                                          cfg.get("start_end_list"))


def _strip_model(layer: str) -> str:
    return layer[len("model."):] if layer.startswith("model.") else layer


def _example_names(model: torch.nn.Module) -> list:
    names = [getattr(m, "name", None) for m in model.modules()]
    return [n for n in names if isinstance(n, str)][:4]


def _reset_nvdlfw() -> None:
    """nvdlfw-inspect keeps registries in class attributes; start from a clean slate."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.config_manager import ConfigManager
    from nvdlfw_inspect.logging import MetricLogger
    from nvdlfw_inspect.registry import Registry

    if debug_api.DEBUG_MANAGER is not None:
        debug_api.end_debug()
    ConfigManager.reset()
    Registry.reset()
    MetricLogger.enabled_loggers.clear()
    for name in ("nvdlfw_inspect", "Default Statistics"):  # its file loggers add a handler per start
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            log.removeHandler(handler)
            handler.close()
