"""Selected tensors from which no value came, named in words instead of dropped without one.

* A section that selects a step and brought no value from any of its layers (:class:`SilentSections`):
  a tensor name the hooks do not measure, a feature nothing calls, layers that did not run, or
  layers that ran with empty tensors (0 elements on every rank: no statistic exists).
* A selected gradient that never comes because the layer's output needed none
  (:func:`no_gradient_reason`): the layer is frozen, and so is everything its input came from.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .features import TENSORS
from .schedule import enabled_features, selected_tensors, stats_step
from .selection import numbered

__all__ = ["SilentSections", "no_gradient_reason"]

logger = logging.getLogger("distmetrics")


class SilentSections:
    """Warns once per section that selects a step but yielded no value, naming the step as
    records do and nvdlfw-inspect's iteration, and the tensor names that brought nothing:
    nvdlfw's base ``LogTensorStats`` takes any name (a user's own calls log theirs), so
    ``tensors: [activations]`` was accepted and measured nothing."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.sections: list = []  # (name, nvdlfw's parsed section) of the enabled sections
        self._full: Optional[dict[str, list]] = None  # a metric's layer -> the layer names it stands for
        self._said: set = set()

    def names_changed(self) -> None:
        """A model was attached: the layer names are read again at the next check."""
        self._full = None

    def __call__(self, metrics: dict, empty: set, layer_names: dict, step: int, iteration: int, says: bool,
                 paused: bool = False) -> None:
        """Check the sections that select ``iteration`` against the ``tensor_stats/...`` written;
        ``empty``: the (metric layer, tensor) that ran but held no element on any rank;
        ``layer_names``: nvdlfw-inspect's layer name -> ours; warn where ``says``; ``paused``: this
        rank skipped a selected layer's forward in ``monitor.pause()``."""
        from nvdlfw_inspect.config_manager import is_layer_in_cfg

        full = self._full
        if full is None:  # wrapper levels kept: the selectors see them
            full = self._full = {}
            for layer, metric_layer in layer_names.items():
                full.setdefault(metric_layer, []).append(layer)
        written = {key[len("tensor_stats/"):].rsplit("/", 2)[0] for key in metrics if key.count("/") >= 3}
        layers = {name for layer in written for name in full.get(layer, ["model." + layer])}
        for section, cfg in self.sections:
            if section in self._said or not stats_step({section: self.spec[section]}, iteration):
                continue
            if not any(numbered(is_layer_in_cfg, layer, cfg) for layer in layers):
                self._said.add(section)
                held = sorted((name, tensor) for layer, tensor in empty for name in full.get(layer, ["model." + layer])
                              if numbered(is_layer_in_cfg, name, cfg))
                if says:
                    logger.warning(self.message(section, step, iteration, held) + (
                        "; monitor.pause() was open during forwards of that step, which are then an evaluation's and "
                        "not measured: call monitor.resume() before the training forwards" if paused else ""))

    def message(self, section: str, step: int, iteration: int, empty: Any = ()) -> str:
        """The warning for a section that brought no value at ``step``; ``empty``: its (layer,
        tensor) that ran and held no element on any rank (then there is nothing to advise)."""
        body = self.spec[section]
        names = selected_tensors(body, iteration)
        named = f" for tensor(s) {', '.join(map(repr, names))}" if names else ""
        hint = f"; the Monitor's hooks measure {', '.join(TENSORS)} of a layer run in a training forward of " \
            "that step, and other tensor names come only from your own debug_api.log_tensor_stats calls" \
            if enabled_features(body, hooked_only=True) else " (is its feature called on them?)"
        if empty:
            hint = ": the layers ran, but their tensors were empty (0 elements) on every rank, and an empty " \
                f"tensor has no statistics ({', '.join(f'{layer} {tensor}' for layer, tensor in empty)})"
        return (f"distmetrics: tensor_inspect.features section {section!r} selects step {step} (nvdlfw-inspect's "
                f"iteration {iteration}) but no value came from any of its layers{named}{hint}")


def no_gradient_reason(step: int, iteration: int, trainable: bool = False) -> str:
    """Why a layer whose output needed no gradient in a training forward has no gradient to measure:
    ``trainable``, the layer holds trainable parameters (its output is not differentiable: a router's
    integer indices); else it is frozen, as is all its input came from."""
    why = ("the layer has trainable parameters, but the tensor it returns first (the one measured) is not "
           "differentiable (integer indices, a detached result)" if trainable else
           "the layer is frozen (requires_grad=False), and so is every layer its input came from (or the input "
           "was made under torch.no_grad() or detached)")
    return (f"its output needed no gradient in the training forward of step {step} (nvdlfw-inspect's iteration "
            f"{iteration}): {why}, so backward never reaches it (named at the first such step only)")
