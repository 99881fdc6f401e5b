"""The inspector: runs a features file for one model — names and hooks its layers, reduces each
selected step's statistics in one collective, forwards TransformerEngine's values.

Two paths, one features file:

* ``distmetrics:`` sections and nvdlfw-inspect's own base ``LogTensorStats`` (any PyTorch module,
  CPU or GPU): module hooks (:mod:`~distmetrics.tensor_stats.layer_hooks`) measure the tensors on
  the steps the YAML selects (the base feature is measured as ours, not called: it would gather each
  tensor inside the hook). Both keep
  on-device partials merged across micro-batches (:mod:`~distmetrics.tensor_stats.statistics`). At the end of such a step every
  rank's partials for every layer travel as **one** vector in one all-gather (the reducer's
  ``all`` pack, so pipeline stages holding different layers agree on a layout) and are merged
  over all ranks in one vectorised pass (:mod:`~distmetrics.tensor_stats.rank_merge`).
* ``transformer_engine:`` sections (TE layers on a GPU) and nvdlfw's base features called from
  the user's code: TE (or the base feature) computes and reduces these itself and logs them (TE inside ``debug_api.step()``);
  they arrive through a :class:`ForwardingLogger` and join the same all-gather on the steps the YAML
  selects (every rank reads that from the YAML, so pipeline stages without selected layers
  join too). A value logged on any other step rides the next log step's MAX pack.

A section that yields no value on a step it selects is named in one warning (e.g. a feature that
nothing calls on the layers it selects, or layers whose tensors were empty), and so is a tensor it
selects that a layer cannot give (a dict output, a container without a weight:
:mod:`~distmetrics.tensor_stats.layer_tensors`; the gradient of a frozen layer whose output needs
none: :mod:`~distmetrics.tensor_stats.unmeasured`).

A weight is the parameter the optimizer steps (FSDP2's sharded one, however the layer is wrapped).
Data-parallel replicas hold the same weights: a weight's shards and pieces count where their rank
owns them (:mod:`distmetrics.parallel`), and a plain replicated weight (DDP's) is sent by every rank
that ran its layer, the lowest one's written (:data:`~.rank_merge.REPLICA`), so counts and norms are
not multiplied. Activations, inputs and
gradients are measured on every rank: tensor- and context-parallel peers hold either copies of
one tensor (a row-parallel layer's all-reduced output) or different pieces of it (a
column-parallel layer's output, sequence-parallel regions, context parallelism's sequence
chunks), which no hook can tell apart. The merge does: a peer whose partials equal, bit for bit,
those of the lowest rank of its TP x CP group holds a copy and is left out; pieces are merged.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..eager import eager
from ..parallel import (data_parallel_group, holds_first_replica, local_tensor, owns_local_piece, plain_replica,
                        tp_cp_leader)
from ..per_rank import PerRank, some_ranks
from ..reduce import Reducer
from ..collectors.base import Alert, LogContext, Sample
from .compiled import fullgraph_error, fullgraph_owner, hold_hook_guards, named_layers, release_hook_guards
from .schedule import stats_step, tensor_names
from .layer_hooks import StandIns, base_feature, forward_hook
from .layer_tensors import OptimizerWeights, Unreadable
from .selection import config_for_layer, example_names, numbered
from .rank_merge import FORWARDED, OWED, PEERS, REPLICA, combine
from .statistics import PARTS, merge, partials
from .te_names import metric_layers, metric_name, shadowed_layers, strip_model
from .unmeasured import SilentSections, no_gradient_reason

__all__ = ["TensorInspector", "ForwardingLogger"]

logger = logging.getLogger("distmetrics")

_UNSELECTED = "_tensor_stats/"
"""Lanes of values logged at steps the YAML does not select (``_`` + the metric's name), for the log step."""


class ForwardingLogger:
    """nvdlfw-inspect statistics logger that hands values to the inspector (TE and base features).

    Built lazily as a ``BaseLogger`` subclass so nvdlfw-inspect stays an optional import."""

    def __new__(cls, inspector: "TensorInspector"):
        from nvdlfw_inspect.logging import BaseLogger

        class _Logger(BaseLogger):
            def log_scalar(self, name, value, iteration, **kwargs):
                inspector.forwarded[inspector.metric_name(name)] = value

        return _Logger()


class TensorInspector:
    """Tensor statistics of one run; a collector (``tensor_stats``) of the Monitor.

    Made by :func:`distmetrics.tensor_stats.initialize`, which starts nvdlfw-inspect for it."""

    name = "tensor_stats"
    after = ()
    writes = ("tensor_stats/",)

    def __init__(self, spec: dict, init_training_step: int = 0, group: Any = None) -> None:
        import nvdlfw_inspect.api as debug_api

        self.debug_api = debug_api
        self.spec = spec
        self.forwarded: dict[str, Any] = {}
        self._clashes_said: set = set()  # forwarded names the hooks measured too, named once each
        self.unselected: dict[str, Any] = {}  # forwarded at steps the YAML does not select: the next log step's
        self.partials: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.requested: dict[tuple[str, str], list] = {}
        self.reducer = Reducer(group)
        self.iteration = init_training_step
        self.layout: Any = None
        self._leader = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.selected: dict[str, list[str]] = {}
        self.layer_names: dict[str, str] = {}  # nvdlfw-inspect's layer name -> ours (te_names.metric_layers)
        self._tensor_names = tensor_names(spec)  # the tensors the file names (a name may hold '_')
        self._hooks: list = []
        self._guards_held = False  # Dynamo guards on hooks while ours are on (compiled.hold_hook_guards)
        self._hooked: dict[str, list] = {}  # our layer name -> (nvdlfw-inspect's name, module) hooked under it
        self.stand_ins = StandIns()  # modules running a copied hook that stand in the hooked one's place
        self._section_of: dict[str, Optional[str]] = {}  # nvdlfw-inspect's layer name -> the section selecting it
        self._shadowed: set = set()  # wrappers whose values are their wrapped layer's (see attach)
        self._models: list = []
        self._vector_names: dict[tuple, tuple] = {}
        self._stage = ""  # this rank's stage prefix where pipeline stages hold modules of one name (name_stage)
        self._silent_sections = SilentSections(spec)  # names a section that yields no value, once
        self.weights_done: set = set()  # (layer, feature) whose weight was logged this step
        self._weight_calls: list = []  # (layer, feature, module, call) of each hook measuring a weight
        self._owing = False  # add() marks a weight owed instead of measuring it (end_step)
        self.owed: set = set()  # layers whose counted weight shard this rank did not measure this step
        self._owed_said: set = set()
        self.optimizer_weights = OptimizerWeights()  # a layer's weight -> the parameter the optimizer steps
        self.unreadable = Unreadable()  # names a selected tensor a layer cannot give, once
        # layer -> forwards of this step run without grad whose gradient is owed: reentrant activation
        # checkpointing (torch's use_reentrant=True, Megatron's recompute) runs the forward under no_grad,
        # then again inside backward, where that recomputation's output is backpropagated
        self.gradient_owed: dict[str, int] = {}
        self.no_gradient: dict = {}  # layers whose selected gradient no forward of this step made -> trainable
        self.on_close: Any = None  # set by the lifecycle: ends nvdlfw-inspect with this inspector
        self.claimed = False  # a Monitor reports this inspector's values
        self.active = stats_step(spec, self.iteration, hooked_only=True)
        self.paused = False  # monitor.pause(): evaluation's forwards are not the step's
        self.paused_forwards = False  # a selected layer's forward came while paused, this step

    def use_guard(self, guard: Any) -> None:
        """Guard the statistics steps' gather with the Monitor's arrival check."""
        self.reducer.guard, self.reducer.call = guard, "monitor.step (tensor statistics)"

    def set_layout(self, layout: Any) -> None:
        """TE's features reduce over nvdlfw-inspect's tensor reduction group: the data-parallel
        peers (pipeline stages and tensor-parallel ranks hold different layers or shards). The
        statistics' own gather runs over the Monitor's ranks (``layout.group``)."""
        self.layout = layout
        if getattr(layout, "group", None) is not self.reducer.group:
            self.reducer = Reducer(layout.group)
        self._leader = tp_cp_leader(layout)  # the same on TP/CP peers: their copies are told apart at the merge
        self.unreadable.says = holds_first_replica(layout)
        group = data_parallel_group(layout)
        if group is None and dist.is_available() and dist.is_initialized():  # a plain layout (DDP): the Monitor's
            group = layout.group if layout.group is not None else dist.group.WORLD  # ranks are the peers
        if group is not None:  # (none: nvdlfw-inspect warned at every call that it had no group)
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
        self.optimizer_weights.models.append(model)
        self.debug_api.infer_and_assign_layer_names(model)
        modules = named_layers(model)
        fullgraph = fullgraph_owner(model)
        self.layer_names.update((layer, self._stage + name) for layer, name in metric_layers(model).items())
        self._silent_sections.names_changed()
        sections = [name for name, body in self.spec.items() if body.get("enabled")]
        matched = [any(numbered(is_layer_in_cfg, name, spec) for _, name in modules) for spec in ConfigManager.configs]
        error = None
        section_of = {id(spec.extension_config): section for section, spec in zip(sections, ConfigManager.configs)}
        paths = {id(m): path for path, m in model.named_modules()}
        for module, name in modules:
            try:
                cfg = config_for_layer(ConfigManager, is_layer_in_cfg, name, sections)
            except ValueError as err:  # two sections target one layer
                error = f"tensor_inspect.features: {err}"
                break
            if cfg:
                self.selected[name] = list(cfg)
                self._section_of[name] = section_of.get(id(cfg))
            for namespace in ("distmetrics", "base"):  # the features our hooks call
                feature = cfg.get(namespace, {}).get("LogTensorStats")
                if not (feature and feature.get("enabled", False)):
                    continue
                if id(module) in fullgraph:  # else Dynamo's Unsupported at the hook, every rank, first forward
                    error = error or fullgraph_error(name, fullgraph[id(module)])
                else:
                    tensors = [e["tensor"] for e in feature.get("tensors_struct", [])] or list(feature.get("tensors", []))
                    self._hook(module, name, tensors, namespace, feature, (model, paths.get(id(module))))
        self._silent_sections.sections = list(zip(sections, ConfigManager.configs))
        # A wrapper and the layer it wraps, both selected, measure the same tensors under one name:
        # the innermost layer's count once (two values under one name would stop the reduction);
        # two other modules under one name are refused (te_names.shadowed_layers)
        self._shadowed, clash = shadowed_layers(self._hooked, paths, self._section_of)
        error = error or clash or None
        flags = self._any_rank(matched + [error is not None])
        if flags[-1]:
            raise ConfigError(error or "tensor_inspect.features: another rank's layers were rejected (see its error)")
        unmatched = [section for section, hit in zip(sections, flags[:-1]) if not hit]
        if unmatched:
            orig = any("_orig_mod" in str(self.spec[section]) for section in unmatched)
            raise ConfigError(f"tensor_inspect.features: section(s) {unmatched} select no layer of the model on any "
                              f"rank (layer names look like {example_names(model)})" + (
                                  "; layer names have no '_orig_mod' level: torch.compile's wrapper takes the name of "
                                  "the module it wraps, as an eager model names it" if orig else ""))
        if self._hooks and not self._guards_held:
            self._guards_held = True
            hold_hook_guards(model, self.layout is None or self.layout.says_once)

    def _any_rank(self, flags: list) -> list:
        """Element-wise OR of ``flags`` over the reducer's ranks (one all-reduce)."""
        if not self.reducer.distributed:
            return [bool(f) for f in flags]
        packed = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64, device=self.reducer.device)
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=self.reducer.group)
        return [bool(v) for v in packed.tolist()]

    def _hook(self, module: torch.nn.Module, name: str, tensors: list, namespace: str, feature: dict,
              place: tuple = (None, None)) -> None:
        """Call the feature on the module's tensors on the selected steps (:mod:`.layer_hooks`).
        nvdlfw-inspect's base ``LogTensorStats`` is measured as ours, not called. ``place``: the model
        and the module's path in it (where a module swapped in stands)."""
        self._hooked.setdefault(self._metric_layer(name), []).append((name, module))
        if namespace == "distmetrics":
            log = self.debug_api.distmetrics.log_tensor_stats

            def call(tensor_name: str, tensor: torch.Tensor) -> None:
                log(name, tensor_name=tensor_name, tensor=tensor, iteration=self.iteration)
        else:
            call = base_feature(self, name, feature)
        if "weight" in tensors:
            self._weight_calls.append((name, namespace, module, call))
        hook = eager(forward_hook(self, module, name, tensors, namespace, feature, call, place))
        self._hooks.append(module.register_forward_hook(hook, with_kwargs=True))  # under compile, run as it is

    def metric_name(self, logged: str) -> str:
        """Our name for a value logged as ``<layer>_<tensor>_<stat>``."""
        return metric_name(logged, self.layer_names, self._tensor_names)

    def _metric_layer(self, layer: str) -> str:
        """Our name for nvdlfw-inspect's layer ``layer`` (as norm names name its module)."""
        name = self.layer_names.get(layer)
        return name if name is not None else self._stage + strip_model(layer)

    def name_stage(self, prefix: str) -> None:
        """Start every layer's name with this rank's pipeline stage (``stage1.``), as norm names do where
        stages hold modules of one name: their statistics were merged (a weight: the first stage's alone)."""
        self._stage = prefix
        self.layer_names = {layer: prefix + name for layer, name in self.layer_names.items()}
        self._vector_names = {}
        self._silent_sections.names_changed()

    # --- accumulation (called through the feature) ----------------------------------------
    def add(self, layer: str, tensor_name: str, tensor: torch.Tensor, stats: list) -> None:
        """Merge one tensor's statistics into this step's partials for (layer, tensor)."""
        if layer in self._shadowed:
            return
        if self._owing:  # a weight due at this step whose layer did not run here: owed where its shard counts
            if not plain_replica(tensor, self.layout) and owns_local_piece(tensor, tensor, layer, self.layout, getattr(
                    self.layout, "group", None)):
                self.owed.add(layer)
            return
        if tensor.is_complex():  # as real values its imaginary part would be dropped (nvdlfw-inspect's min and max
            self.unreadable(layer, tensor_name, f"it is complex ({tensor.dtype}), and the statistics are of real "
                            "values")  # raise on it; its norms are of |z|): named, not measured
            return
        if tensor_name == "weight":
            if plain_replica(tensor, self.layout):  # every rank that ran the layer sends it: one is written
                tensor_name = REPLICA + tensor_name
            elif not owns_local_piece(tensor, tensor, layer, self.layout, getattr(self.layout, "group", None)):
                return  # a copy of a shard another rank reports; shards count everywhere
        x = local_tensor(tensor.detach()).reshape(-1).to(torch.float64)
        batch = partials(x)  # an empty tensor's too: it travels with count 0, and the warning can say it was empty
        key = (layer, tensor_name)
        self.requested[key] = list(stats)
        self.partials[key] = batch if key not in self.partials else merge(self.partials[key], batch)

    # --- per step ------------------------------------------------------------------------
    def end_step(self, step: int = 0) -> Optional[dict]:
        """After training step ``step``: reduce this step's statistics (every rank, one collective
        on steps the YAML selects, none otherwise; ranks at different steps raise); returns
        ``tensor_stats/...`` metrics."""
        gather = stats_step(self.spec, self.iteration)
        self._name_missing_gradients(step)
        if gather:
            self._owe_weights()
        # TE's features log (and reduce among themselves) inside step(): run it first so their
        # values of this step travel with ours.
        self.debug_api.step()
        metrics = None
        if gather:
            samples = []
            if self.partials:
                keys = tuple(sorted(self.partials))
                names = self._vector_names.get(keys)
                if names is None:  # the layer last: any character of a module's name may be in it
                    names = self._vector_names[keys] = tuple(
                        f"{tensor}|{','.join(self.requested[(layer, tensor)])}|{part}|{self._metric_layer(layer)}"
                        for layer, tensor in keys for part in PARTS)
                values = torch.stack([self.partials[key][part] for key in keys for part in PARTS])
                samples.append(Sample("tensor_stats", values, "all", names=names))
            samples += [Sample(f"{FORWARDED}{name}", value, "all") for name, value in self.forwarded.items()]
            samples += [Sample(f"{OWED}{self._metric_layer(layer)}", 1.0, "all") for layer in sorted(self.owed)]
            samples.append(Sample(PEERS, float(self._leader), "all"))
            empty: set = set()
            clashes: set = set()
            owed: dict = {}
            metrics = combine(self.reducer.reduce(samples, tag=step).per_rank, empty, clashes, owed)
            self._say_clashes(clashes - self._clashes_said, step)
            self._say_owed(owed, step)
            refused, self.reducer.refused = self.reducer.refused, None
            if refused is not None:  # names the ranks disagree on, found alike on every rank: every rank raises
                raise refused
            # the owed weights count as come for the sections' check: said above
            came = {**metrics, **{f"tensor_stats/{layer}/weight/owed": None for layer in owed}} if owed else metrics
            self._silent_sections(came, empty, self.layer_names, step, self.iteration,
                                  self.layout is None or self.layout.says_once, self.paused_forwards)
            self.partials = {}
            self.forwarded = {}
        elif self.forwarded:  # logged at a step no feature selects: the next log step's train record has them,
            self.unselected.update(self.forwarded)  # not the next selected step's tensor_stats record
            self.forwarded = {}
        self.weights_done = set()
        self.owed = set()
        self.gradient_owed = {}
        self.paused_forwards = False
        self.iteration += 1
        self.active = stats_step(self.spec, self.iteration, hooked_only=True)
        return metrics

    def _owe_weights(self) -> None:
        """Before a selected step's reduction: each hooked layer whose weight is due at this step (the
        feature decides, as in its forward) but that did not run on this rank marks its counted shard
        owed (:data:`~.rank_merge.OWED`): the other ranks' shards alone are not the weight's statistics."""
        self._owing = True
        try:
            for name, namespace, module, call in self._weight_calls:
                weight = getattr(module, "weight", None)
                if (name, namespace) not in self.weights_done and module.training and isinstance(weight, torch.Tensor):
                    call("weight", self.optimizer_weights(weight))
        finally:
            self._owing = False

    def _say_owed(self, owed: dict, step: int) -> None:
        """Name, once per layer, a weight left out because a rank holding a shard of it did not run its layer."""
        new = {layer: ranks for layer, ranks in owed.items() if layer not in self._owed_said}
        self._owed_said.update(new)
        if new and (self.layout is None or self.layout.says_once):
            logger.warning("distmetrics: tensor_stats/<layer>/weight at step %d is left out for %s: the rank(s) "
                           "holding a shard of it that did not run the layer in the step (layer drop) measured no "
                           "shard, and the others' shards are not the weight (said once per layer)", step,
                           "; ".join(f"{layer} ({some_ranks(ranks)})" for layer, ranks in sorted(new.items())))

    def _say_clashes(self, clashes: set, step: int) -> None:
        """Name, once each, the statistics a ``debug_api.log_tensor_stats`` call logged under a name the
        features file's hooks also measure (found alike on every rank: the first rank says it)."""
        if clashes:
            self._clashes_said |= clashes
            if self.layout is None or self.layout.says_once:
                logger.warning("distmetrics: %s at step %d: a debug_api.log_tensor_stats call logged a value under "
                               "the name of a statistic the features file's hooks measure; the hooks' value is "
                               "written, the call's is not: give the call another tensor_name (said once per name)",
                               ", ".join(sorted(clashes)), step)

    def _name_missing_gradients(self, step: int) -> None:
        """Name a selected gradient no training forward of step ``step`` gave (its layer's output
        needed none: the layer is frozen, and so is all its input came from), once per layer.
        Evaluation forwards and those under ``torch.no_grad()`` are not the step's and say nothing;
        a layer frozen for some steps only is named at the first of them."""
        for layer, trainable in sorted(self.no_gradient.items()):
            if (layer, "gradient") not in self.partials:  # another micro-batch's forward gave it
                self.unreadable(layer, "gradient", no_gradient_reason(step, self.iteration, trainable))
        self.no_gradient = {}

    def pause(self) -> None:
        """``monitor.pause()``: forwards until :meth:`resume` are an evaluation's, not the step's."""
        self.paused = True

    def resume(self) -> None:
        """Count the forwards again."""
        self.paused = False

    # --- the collector contract -----------------------------------------------------------
    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Values logged outside the YAML's stats steps (e.g. a user's own
        ``debug_api.log_tensor_stats`` call), the last of each name: every rank's, the lowest written (as
        at a selected step; a max over ranks of each name mixed ranks: one's ``min`` beside another's ``max``)."""
        if ctx.ended_at is None:  # a pause still open at a log step ends there, as the clocks' (not at close())
            self.paused = False
        values, self.unselected = {**self.unselected, **self.forwarded}, {}  # forwarded: logged after the last step
        self.forwarded = {}
        return [Sample("_" + name, value, "all") for name, value in values.items()]

    def finalize(self, metrics: dict, ctx: LogContext) -> list[Alert]:
        """Forwarded values: the lowest rank's that logged each (its lane's summaries start with '_': left out)."""
        for lane in ctx.keys_under(metrics, (_UNSELECTED,)):
            values = metrics.get(lane)
            if isinstance(values, PerRank) and values.present():
                metrics[lane[1:]] = values.present()[0]
        return []

    def close(self) -> None:
        """Remove the hooks and end nvdlfw-inspect (``end_debug``) if this inspector runs it."""
        self.remove_hooks()
        if self.on_close is not None:
            self.on_close()

    def remove_hooks(self) -> None:
        """Take the forward hooks off the model's layers."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._guards_held:
            self._guards_held = False
            release_hook_guards()

