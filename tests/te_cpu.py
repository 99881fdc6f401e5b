"""A linear layer that talks to nvdlfw-inspect the way TransformerEngine's ``te.Linear`` does,
with FP8 (E4M3, current scaling) emulated by torch's ``float8_e4m3fn`` on CPU.

Test infrastructure for what cannot exist on these machines (TE needs a GPU); it pairs with the
feature folder ``tests/te_cpu_features``. Each step the layer asks
``inspect_tensor_enabled`` per tensor and, where enabled, passes the high-precision tensor, its
quantized form and the quantizer to ``inspect_tensor`` — the activation and weight in forward,
the output's gradient in backward.
"""

from __future__ import annotations

from pathlib import Path

import torch

FEATURES_DIR = str(Path(__file__).resolve().parent / "te_cpu_features")
E4M3_MAX = 448.0


class CurrentScalingQuantizer:
    """Per-tensor current scaling: scale = E4M3_MAX / amax."""

    recipe = "fp8_current_scaling"

    def __call__(self, x: torch.Tensor) -> "Fp8Tensor":
        amax = x.detach().abs().max().to(torch.float32)
        scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
        data = (x.detach().to(torch.float32) * scale).to(torch.float8_e4m3fn)
        return Fp8Tensor(data, (1.0 / scale).reshape(1))


class Fp8Tensor:
    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self._data = data
        self._scale_inv = scale_inv

    def dequantize(self) -> torch.Tensor:
        return self._data.to(torch.float32) * self._scale_inv


class Fp8Linear(torch.nn.Linear):
    """``y = deq(q(x)) @ deq(q(W))ᵀ + b`` (straight-through), inspected like ``te.Linear``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quantizer = CurrentScalingQuantizer()
        self.name = None  # assigned by nvdlfw-inspect's infer_and_assign_layer_names

    def _inspect(self, tensor_name: str, tensor: torch.Tensor, quantized: Fp8Tensor) -> None:
        import nvdlfw_inspect.api as debug_api

        iteration = debug_api.DEBUG_MANAGER._trainer_iteration_count
        enabled = debug_api.transformer_engine.inspect_tensor_enabled(
            layer_name=self.name, tensor_name=tensor_name, iteration=iteration)
        if isinstance(enabled, tuple):
            enabled = enabled[0]
        if enabled:
            debug_api.transformer_engine.inspect_tensor(
                layer_name=self.name, tensor_name=tensor_name, iteration=iteration, tp_group=None, tp_size=1,
                tensor=tensor, rowwise_quantized_tensor=quantized, columnwise_quantized_tensor=quantized,
                quantizer=self.quantizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qx, qw = self.quantizer(x), self.quantizer(self.weight)
        self._inspect("activation", x, qx)
        self._inspect("weight", self.weight, qw)
        x_fp8 = x + (qx.dequantize() - x).detach()
        w_fp8 = self.weight + (qw.dequantize() - self.weight).detach()
        out = torch.nn.functional.linear(x_fp8, w_fp8, self.bias)
        if out.requires_grad:
            out.register_hook(lambda grad: self._inspect("gradient", grad, self.quantizer(grad)))
        return out
