"""Running Megatron-Core on a CPU-only machine (gloo): narrow adaptations.

1. A no-op RNG tracker instead of CUDA RNG states
   (``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``).
2. ``GlobalMemoryBuffer.get_tensor`` allocates on the CPU instead of the current CUDA device.
3. ``Tensor.cuda()`` is the identity while a model is built: with pipeline parallelism and tied
   embeddings, Megatron moves the shared weight to CUDA before all-reducing it across stages.
4. :func:`cuda_on_cpu`, around exactly three calls of Megatron's ``DistributedDataParallel`` +
   ``DistributedOptimizer``: building the DDP wrapper, ``get_megatron_optimizer`` and
   ``optimizer.step()``. Forward, backward, ``finish_grad_sync`` and ``zero_grad_buffer`` need
   nothing. The buffers, range maps, reduce-scatter, all-gather and the inner ``torch.optim``
   step are Megatron's and torch's own code on CPU tensors over gloo.

Nothing here is needed (or applied) when CUDA is available.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode


def apply_cpu_adaptations(seed: int = 1234) -> None:
    """Seed like Megatron's ``_set_random_seed`` (the same on TP and DP peers, offset per
    pipeline stage), then adaptations 1 and 2. Call after ``initialize_model_parallel``."""
    from megatron.core import parallel_state as ps

    torch.manual_seed(seed + 100 * ps.get_pipeline_model_parallel_rank())
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.random.model_parallel_cuda_manual_seed(seed)
        return
    import megatron.core.utils as mutils
    from megatron.core import tensor_parallel

    tensor_parallel.random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor


@contextlib.contextmanager
def cpu_model_construction():
    """Adaptation 3, only around model construction."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def build_gpt(num_layers: int = 4, hidden: int = 32, heads: int = 4, vocab: int = 64, seq: int = 16,
              tp: int = 1, pp: int = 1, tied: bool = True, use_te: bool = False, experts: int = 0, ep: int = 1,
              etp: int | None = None, fp8: str | None = None, fp8_recipe: str = "delayed"):
    """A Megatron-Core GPTModel for this rank's pipeline stage (local spec on CPU).

    ``experts`` > 0 makes every MLP a mixture of experts (top-2 router, experts in a
    SequentialMLP), split over ``ep`` expert-parallel ranks and ``etp`` expert-tensor-parallel
    ranks (default: ``tp``). On CPU such a model builds, but its forward runs only with more patches
    than this module applies (megatron-core 0.16 leaves TE's GEMM name unbound, and its backward
    allocates on ``torch.cuda.current_device()``). ``fp8`` (``e4m3``/``hybrid``, with ``use_te``) trains
    the TE layers in FP8 with ``fp8_recipe``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec as spec_fn
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as spec_fn
    extra = {"fp8": fp8, "fp8_recipe": fp8_recipe} if fp8 else {}
    if experts:
        extra |= {"num_moe_experts": experts, "moe_router_topk": 2, "expert_model_parallel_size": ep,
               "expert_tensor_parallel_size": tp if etp is None else etp, "moe_token_dispatcher_type": "allgather",
               "add_bias_linear": False}  # Megatron: no bias in experts split over expert-TP
    config = TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                               use_cpu_initialization=not torch.cuda.is_available(),
                               pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    spec = spec_fn(num_experts=experts, moe_grouped_gemm=False) if experts else spec_fn()
    with cpu_model_construction():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                        max_sequence_length=seq, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=tied)


def wrap_with_optimizer(model: torch.nn.Module, lr: float, clip_grad: float, distributed: bool = True,
                        bf16: bool = False, weight_decay: float = 0.01, fp16: bool = False,
                        loss_scale: Optional[float] = None, grad_reduce_in_fp32: bool = True,
                        initial_loss_scale: float = 2.0 ** 32) -> tuple:
    """``model`` under Megatron's ``DistributedDataParallel`` (no overlap; fp32 gradient buffers
    and reduction, or with ``grad_reduce_in_fp32=False``, Megatron's default, buffers in the
    parameters' dtype) and its Adam from ``get_megatron_optimizer`` (the ``DistributedOptimizer`` when
    ``distributed``; Megatron clips at ``clip_grad``; ``fp16`` with a static ``loss_scale``, or
    Megatron's dynamic one from ``initial_loss_scale`` where None), built through :func:`cuda_on_cpu`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with cuda_on_cpu():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=distributed, overlap_grad_reduce=False),
            model)
    ddp.broadcast_params()
    with cuda_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, bf16=bf16, fp16=fp16, loss_scale=loss_scale,
            initial_loss_scale=initial_loss_scale, use_distributed_optimizer=distributed, clip_grad=clip_grad), [ddp])
    return ddp, optimizer


@contextlib.contextmanager
def cuda_on_cpu():
    """Adaptation 4: while active (CPU-only torch),

    * ``torch.cuda.current_device()`` returns 0 instead of raising "Torch not compiled with CUDA
      enabled" (megatron/core/distributed/param_and_grad_buffer.py allocates the param and grad
      buffers on it);
    * a torch call whose ``device=`` names CUDA runs on the CPU (those buffers; the optimizer's
      ``_dummy_overflow_buf``/``_scale_one``; ``get_grad_norm_fp32`` and the clip in
      optimizer/clip_grads.py; ``local_multi_tensor_l2_norm``'s result);
    * ``Tensor.type()`` with no argument names the CUDA type of a CPU tensor, so the type checks
      pass (distrib_optimizer.py ``_build_model_and_main_param_groups``, the assert in
      ``clip_grad_by_total_norm_fp32``); ``Tensor.type(dtype)`` casts are untouched.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.cuda.current_device = original


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and not isinstance(device, bool) and (
                isinstance(device, int) or str(device).startswith("cuda")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and not name.startswith("torch.cuda."):
                name = "torch.cuda." + name[len("torch."):]
            return name
        return func(*args, **kwargs)
