"""distmetrics' feature namespace for nvdlfw-inspect: tensor statistics without TransformerEngine.

Loaded by nvdlfw-inspect from this folder (``feature_dirs``); selected in a features YAML under
the ``distmetrics:`` key with the usual syntax::

    my_section:
      enabled: true
      layers: {layer_name_regex_pattern: ".*fc1"}
      distmetrics:
        LogTensorStats:
          enabled: true
          tensors: [activation, weight, gradient]
          stats: [min, max, mean, std, l1_norm, l2_norm]
          freq: 2
          start_step: 0
          end_step: 100

The feature only accumulates on-device partial statistics; distmetrics reduces every layer's
in one collective per step and writes them (``tensor_stats/<layer>/<tensor>/<stat>``).
"""

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.logging import enable_logging_at_current_step
from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_feature(namespace="distmetrics")
class LogTensorStats(GenericConfigAPIMapper):
    """Statistics of a module's activation, input, weight or gradient (the output's gradient):
    min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range."""

    @api_method
    def log_tensor_stats(self, config, layer_name, **kwargs):
        """Route the call to the layer's LogTensorStats feature."""
        """On the steps the config selects, merge ``kwargs['tensor']``'s statistics into the step's partials."""
        iteration = kwargs.get("iteration", debug_api.DEBUG_MANAGER._trainer_iteration_count)
        if not enable_logging_at_current_step(iteration, int(config.get("freq", 1)), config.get("start_step", 0),
                                              config.get("end_step", -1), config.get("start_end_list")):
            return {}
        from distmetrics.tensor_stats.lifecycle import accumulate

        accumulate(layer_name, kwargs["tensor_name"], kwargs["tensor"], config.get("stats", []))
        return {}


@Registry.register_namespace_api(namespace="distmetrics")
class DistmetricsInspectAPI(BaseNamespaceAPI):
    """The ``distmetrics`` namespace's API: ``debug_api.distmetrics.log_tensor_stats(layer, tensor=, tensor_name=)``."""

    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._cacheable_api_kwargs_map = {"log_tensor_stats": ["tensor_name"]}

    def input_assertions_hook(self, api_name, **kwargs):
        """Every call needs tensor= and tensor_name=."""
        assert "tensor" in kwargs and "tensor_name" in kwargs, f"{api_name} needs tensor= and tensor_name="

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        """Route by the config's tensors (nvdlfw-inspect's own parsing)."""
        return feature_obj.parse_config_and_api(config, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        """No output to check."""
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        """One feature per call."""
        return False

    def log_tensor_stats(self, layer_name, **kwargs):
        """Route the call to the layer's LogTensorStats feature."""
        return self.route_api(layer_name, "log_tensor_stats", **kwargs)

    def step(self):
        """Nothing per step: the Monitor reduces and writes."""
        pass

    def end_debug(self):
        """Nothing to release."""
        pass
