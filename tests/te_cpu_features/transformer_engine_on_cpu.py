"""A CPU stand-in for TransformerEngine's debug features (test infrastructure only).

TransformerEngine needs a GPU, so it cannot exist on the test machines. This folder registers
the ``transformer_engine`` namespace with the protocol TE's layers and features use, so the
project's own code (the shipped ``configs/fp8_tensor_stats.yaml``, the Monitor's set-up, the
forwarding of logged values, their names, steps and sinks) runs for real:

* the API TE's layers call: ``inspect_tensor_enabled(layer_name, tensor_name, iteration)`` and
  ``inspect_tensor(layer_name, tensor_name, iteration, tp_group, tensor,
  rowwise_quantized_tensor, columnwise_quantized_tensor, quantizer, tp_size)``;
* ``LogTensorStats`` (min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range) and
  ``LogFp8TensorStats`` (underflows%, scale_inv_min, scale_inv_max, mse, optionally prefixed
  by the training recipe), with TE's step selection (freq, start_step, end_step inclusive);
* TE's reduction rules: activations and gradients accumulate over micro-batches and are
  combined over ``debug_api.get_tensor_reduction_group()``; weights are fed once per step and
  not reduced (each rank logs its own);
* values logged at ``debug_api.step()`` through ``MetricLogger.log_scalar`` as
  ``<layer>_<tensor>_<stat>`` 0-d tensors, as TE's ``StatsBuffers.log_stats`` does.

The statistics are computed here in float64 from sums (the std with Bessel's correction); this
stand-in does not reproduce TE's numerics, only its interface.
"""

import math

import torch
import torch.distributed as dist

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.registry import Registry, api_method

# (layer, tensor, feature) -> {"stats": [...], "parts": float64 tensor, "reduce": bool}
_BUFFERS: dict = {}
_PLAIN = ("n", "sum", "sumsq", "min", "max", "l1", "minabs")
_FP8 = ("n", "underflows", "sq_err", "scale_inv_min", "scale_inv_max")
_RECIPE = "fp8_current_scaling"


def _enabled(config, iteration):
    freq = int(config.get("freq", 1))
    intervals = config.get("start_end_list") or [(config.get("start_step") or 0,
                                                  math.inf if config.get("end_step") is None else config["end_step"])]
    return iteration % freq == 0 and any(s <= iteration <= e for s, e in intervals)


def _merge(kind, a, b):
    if a is None:
        return b
    if kind == "plain":  # n, sum, sumsq add; min, max, minabs extremes; l1 adds
        return torch.stack([a[0] + b[0], a[1] + b[1], a[2] + b[2], torch.minimum(a[3], b[3]),
                            torch.maximum(a[4], b[4]), a[5] + b[5], torch.minimum(a[6], b[6])])
    return torch.stack([a[0] + b[0], a[1] + b[1], a[2] + b[2], torch.minimum(a[3], b[3]), torch.maximum(a[4], b[4])])


def _feed(layer, tensor_name, feature, stats, parts):
    key = (layer, tensor_name, feature)
    buf = _BUFFERS.setdefault(key, {"stats": list(stats), "parts": None, "reduce": tensor_name != "weight"})
    if tensor_name == "weight" and buf["parts"] is not None:
        return  # weights: once per step, not per micro-batch (as TE)
    buf["parts"] = _merge(feature, buf["parts"], parts)


def _plain_value(stat, p):
    n, total, sumsq, lo, hi, l1, minabs = (float(v) for v in p)
    amax = max(abs(lo), abs(hi))
    return {"min": lo, "max": hi, "mean": total / n, "l1_norm": l1, "l2_norm": math.sqrt(sumsq),
            "std": math.sqrt(max(sumsq - total * total / n, 0.0) / (n - 1)) if n > 1 else math.nan,
            "cur_amax": amax,
            "dynamic_range": math.log2(amax) - math.log2(minabs) if amax > 0 and math.isfinite(minabs) else 0.0}[stat]


def _fp8_value(stat, p):
    n, underflows, sq_err, si_min, si_max = (float(v) for v in p)
    base = stat[len(_RECIPE) + 1:] if stat.startswith(_RECIPE + "_") else stat
    return {"underflows%": 100.0 * underflows / n, "mse": sq_err / n,
            "scale_inv_min": si_min, "scale_inv_max": si_max}[base]


def _log_all():
    group = debug_api.get_tensor_reduction_group()
    for (layer, tensor_name, feature), buf in sorted(_BUFFERS.items()):
        parts = buf["parts"]
        if parts is None:
            continue
        if buf["reduce"] and dist.is_initialized():
            gathered = [torch.empty_like(parts) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, parts, group=group)
            parts = None
            for other in gathered:
                parts = _merge(feature, parts, other)
        value = _plain_value if feature == "plain" else _fp8_value
        for stat in buf["stats"]:
            MetricLogger.log_scalar(f"{layer}_{tensor_name}_{stat}", torch.tensor(value(stat, parts), dtype=torch.float64),
                                    debug_api.DEBUG_MANAGER._trainer_iteration_count)
        buf["parts"] = None


class _Feature(GenericConfigAPIMapper):
    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return _enabled(config, iteration), None


@Registry.register_feature(namespace="transformer_engine")
class LogTensorStats(_Feature):
    """High-precision statistics of a TE layer's activation, gradient or weight."""

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None, tp_size=1):
        x = tensor.detach().reshape(-1).to(torch.float64)
        magnitude = x.abs()
        nonzero = magnitude[magnitude > 0]
        parts = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), x.pow(2).sum(), x.min(),
                             x.max(), magnitude.sum(),
                             nonzero.min() if nonzero.numel() else torch.tensor(math.inf, dtype=torch.float64)])
        _feed(layer_name, tensor_name, "plain", config["stats"], parts)


@Registry.register_feature(namespace="transformer_engine")
class LogFp8TensorStats(_Feature):
    """Statistics of a TE layer's tensor after FP8 quantization by the training recipe."""

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None, tp_size=1):
        assert rowwise_quantized_tensor is columnwise_quantized_tensor
        if quantizer is None:
            return
        for stat in config["stats"]:
            base = stat[len(_RECIPE) + 1:] if stat.startswith(_RECIPE + "_") else stat
            if base not in ("underflows%", "scale_inv_min", "scale_inv_max", "mse"):
                raise ValueError(f"Stat {stat} contains an unsupported stat name: {base}")
        x = tensor.detach().reshape(-1).to(torch.float64)
        q = rowwise_quantized_tensor.dequantize().reshape(-1).to(torch.float64)
        scale_inv = rowwise_quantized_tensor._scale_inv.to(torch.float64)
        parts = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64),
                             ((x != 0) & (q == 0)).sum().to(torch.float64), (x - q).pow(2).sum(),
                             scale_inv.min(), scale_inv.max()])
        _feed(layer_name, tensor_name, "fp8", config["stats"], parts)


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineOnCpuAPI(BaseNamespaceAPI):
    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._cacheable_api_kwargs_map = {"inspect_tensor": ["tensor_name"],
                                          "inspect_tensor_enabled": ["tensor_name", "iteration"]}

    def input_assertions_hook(self, api_name, **kwargs):
        assert "tensor_name" in kwargs, f"{api_name} needs tensor_name="

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return feature_obj.parse_config_and_api(config, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return api_name in ("inspect_tensor", "inspect_tensor_enabled")

    def handle_multi_feature_output(self, api_name, multi_feature_outputs, features_to_invoke, **kwargs):
        if api_name == "inspect_tensor_enabled":
            return any(out[0] for out in multi_feature_outputs), None
        return None

    def step(self):
        _log_all()

    def end_debug(self):
        _BUFFERS.clear()
