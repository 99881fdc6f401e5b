"""FLOPs arithmetic: training FLOPs per token from a model description, GPU peaks, MFU.

Pure arithmetic (no torch): the config derives ``flops_per_token`` from it, the throughput
collector turns it into TFLOP/s per GPU and MFU, checkpoints into cumulative FLOPs.
"""

from __future__ import annotations

import math
import re
from typing import Optional

__all__ = ["PEAK_TFLOPS", "peak_tflops_for", "is_mig", "model_flops_per_token", "mfu_pct"]

# Dense peak TFLOP/s of one GPU by math precision (no structured sparsity), from the vendors'
# data sheets. Matched against torch.cuda.get_device_name() in order: the first key found in the
# name as a whole word wins (no letter or digit either side: "A100" is not in "RTX A1000", nor
# "B200" in "GB200", nor "A10" in "A10G"), so the more specific names come first.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0},
    # the NVL boards: half the data sheets' figures "with sparsity" (bf16 1,671, tf32 835, fp8 3,341)
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0, "fp8": 4500.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6, "fp8": 733.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops_for(device_name: str, dtype: str) -> Optional[float]:
    """The peak for a GPU name and precision, or None when the table does not know it, or the name
    is a MIG instance's (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``: a slice of the GPU, whose peak is a
    part of the board's that the name does not give exactly)."""
    if is_mig(device_name):
        return None
    for key, peaks in PEAK_TFLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return peaks.get(dtype)
    return None


def is_mig(device_name: str) -> bool:
    """Whether ``device_name`` names a MIG instance (the word ``MIG`` in it)."""
    return re.search(r"(?<![A-Za-z0-9])MIG(?![A-Za-z0-9])", device_name) is not None


def model_flops_per_token(num_params: float, num_layers: Optional[int] = None, hidden_size: Optional[int] = None,
                          seq_length: Optional[int] = None, num_active_params: Optional[float] = None,
                          attention: str = "causal") -> float:
    """Training FLOPs per token: 6·N (N = parameters active per token, for MoE the routed
    subset) plus attention's QKᵀ and AV, forward and backward: 12·L·h·s for every position
    (``attention="full"``: PaLM's and torchtitan's count) or half of it under a causal mask
    (``"causal"``, 6·L·h·s: Megatron-LM's count, what causal kernels compute)."""
    active = num_active_params if num_active_params else num_params
    per_position = 12.0 if attention == "full" else 6.0
    core = per_position * num_layers * hidden_size * seq_length if num_layers and hidden_size and seq_length else 0.0
    return 6.0 * active + core


def mfu_pct(tflops_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in percent."""
    return 100.0 * tflops_per_gpu / peak_tflops if peak_tflops > 0 else math.nan
