"""Megatron-Core's distributed optimizer: which slice of each gradient a rank owns, and where the
fp32 main parameters it updates live.

With ``use_distributed_optimizer=True`` Megatron's DDP reduce-scatters each gradient buffer
bucket: data-parallel rank r ends up with the reduced gradient of shard r only, while the rest
of its ``main_grad`` still holds its own unreduced local gradient. Counting a rank's whole
``main_grad`` (the data-parallel replica rule) would be wrong everywhere but in its own shard.
So each rank counts exactly the slice it owns — the optimizer's range map
(``model_param_gbuf_map`` → ``gbuf_ranges[...]["param_map"][param]["param"]``), as Megatron's own
``get_grad_norm_fp32`` does — combined with the tensor-parallel rule (``tensor_model_parallel``
params on every TP rank, others on TP rank 0; ``shared`` never). Parameter and update norms come
from the fp32 main-parameter shards the optimizer updates, and the update is measured around the
inner ``torch.optim`` step (hooks on it).

The optimizers attached to one Monitor accumulate (:meth:`MegatronShards.merge`): a MoE model's
``ChainedOptimizer`` holds a dense and an expert ``DistributedOptimizer``, each sharding buffers of
its own, and attached part by part each part's range map counts beside the others'.

Never silently wrong: :func:`check_layout` refuses, at the first measurement, layouts whose
gradients no rule here describes — a model under Megatron's DDP with the distributed optimizer
but no optimizer attached, or a parameter of its gradient buffers that no attached optimizer
shards (one part of a chained optimizer attached without the other), FSDP1 flat parameters,
DeepSpeed ZeRO partitions — naming the parameter and what was found.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["MegatronShards", "is_megatron_optimizer", "check_layout", "LayoutError"]


class LayoutError(ValueError):
    """A parallel layout whose gradients the ownership rule does not cover."""


def is_megatron_optimizer(optimizer: Any) -> bool:
    """A Megatron-Core optimizer (chained, distributed, mixed precision or fp32)."""
    return hasattr(optimizer, "chained_optimizers") or hasattr(optimizer, "get_main_grads_for_grad_norm")


class MegatronShards:
    """The owned slices and main-parameter shards of a Megatron optimizer's distributed parts."""

    def __init__(self, optimizer: Any) -> None:
        parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        self.distributed = [p for p in parts if hasattr(p, "model_param_gbuf_map")]
        self.inner = [p.optimizer for p in parts if isinstance(getattr(p, "optimizer", None), torch.optim.Optimizer)]
        self.ranges: dict[int, tuple[int, int]] = {}  # id(model param) → owned [start, end) of its flat view
        self.params: set[int] = set()  # every model param a distributed optimizer shards
        self.main: dict[int, torch.Tensor] = {}  # id(model param) → the fp32 shard the optimizer updates
        for part in self.distributed:
            self._read(part)

    def merge(self, other: "MegatronShards") -> None:
        """Count ``other``'s parts too (an optimizer attached after this one): range maps and main
        shards accumulate, keyed by parameter, so a part or parameter attached twice counts once."""
        self.distributed += [p for p in other.distributed if not any(p is q for q in self.distributed)]
        self.inner += [p for p in other.inner if not any(p is q for q in self.inner)]
        self.ranges.update(other.ranges)
        self.params |= other.params
        self.main.update(other.main)

    @property
    def active(self) -> bool:
        """True when some parameters are sharded by a distributed optimizer."""
        return bool(self.distributed)

    def owned_slice(self, param: Any, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's owned part of ``tensor`` (a gradient laid out like ``param``); an empty
        tensor when it owns none; None when the optimizer does not shard ``param``."""
        if id(param) not in self.params:
            return None
        span = self.ranges.get(id(param))
        flat = tensor.view(-1)
        return flat[span[0]:span[1]] if span is not None else flat[:0]

    def splits(self, param: Any) -> bool:
        """True when this rank owns part of ``param``'s gradient but not all of it."""
        span = self.ranges.get(id(param))
        return span is not None and 0 < span[1] - span[0] < param.numel()

    def main_shard(self, param: Any) -> Optional[torch.Tensor]:
        """The fp32 main-parameter shard of ``param`` the optimizer updates (empty if this rank
        owns none of it); None when the optimizer does not shard ``param``."""
        if id(param) not in self.params:
            return None
        return self.main.get(id(param), param.detach().view(-1)[:0].float())

    def _read(self, part: Any) -> None:
        for param, (gbuf, dtype, bucket) in part.model_param_gbuf_map.items():
            span = part.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
            self.ranges[id(param)] = (span.start, span.end)
        for buffer in getattr(part, "buffers", None) or []:  # every param of the sharded buffers
            self.params.update(id(p) for p in buffer.param_index_map)
        self.params.update(self.ranges)
        pairs = [("model_fp32_groups", "shard_fp32_groups"), ("model_float16_groups", "shard_fp32_from_float16_groups")]
        for model_groups, shard_groups in pairs:
            for models, shards in zip(getattr(part, model_groups, []), getattr(part, shard_groups, [])):
                for model_param, shard in zip(models, shards):
                    if shard is not None:
                        self.main[id(model_param)] = shard.detach()
        # Precision-aware optimizer (TransformerEngine's FusedAdam): the fp32 masters live in the
        # inner optimizer's state; without one kept there, the 16-bit shard is the parameter.
        inner = getattr(part, "optimizer", None)
        for models, shards in zip(getattr(part, "model_float16_groups", []), getattr(part, "shard_float16_groups", [])):
            for model_param, shard in zip(models, shards):
                if id(model_param) in self.main or shard is None:
                    continue
                try:
                    self.main[id(model_param)] = inner.get_unscaled_state(shard, "master_param").detach()
                except Exception:  # noqa: BLE001
                    self.main[id(model_param)] = shard.detach()


def check_layout(model: Any, params: list, names: list[str], shards: Optional[MegatronShards],
                 grads: bool = True) -> None:
    """Raise :class:`LayoutError` for a layout no ownership rule describes (see the module doc);
    ``grads`` false: for the parameters themselves, whole on every rank under Megatron's DDP."""
    sharded = _distributed_buffer_params(model) if grads else None
    if sharded is not None and (shards is None or not shards.active):
        raise LayoutError(
            f"parameter {names[0]!r}: the model is wrapped in Megatron-Core's DistributedDataParallel with "
            "use_distributed_optimizer=True, so each data-parallel rank holds a reduced shard of the gradient only; "
            "attach the optimizer (Monitor(..., optimizer=opt) or monitor.attach_megatron_optimizer(opt))")
    for param, name in zip(params, names):
        if sharded and id(param) in sharded and id(param) not in shards.params:
            raise LayoutError(
                f"parameter {name!r} is in a gradient buffer of Megatron-Core's DistributedDataParallel with "
                "use_distributed_optimizer=True, but no attached optimizer shards it, so which slice of its "
                "reduce-scattered gradient this rank holds is unknown; attach the other optimizer(s) too: the "
                "ChainedOptimizer itself (Monitor(..., optimizer=opt)), or each of its parts "
                "(monitor.attach_megatron_optimizer(part) for every part of opt.chained_optimizers, a MoE "
                "model's dense and expert ones)")
    for param, name in zip(params, names):
        if getattr(param, "_is_flat_param", False):
            raise LayoutError(f"parameter {name!r} is an FSDP1 FlatParameter (several parameters flattened and "
                              "sharded together); norms per parameter need FSDP2 (fully_shard) or DDP")
        if getattr(param, "_fsdp_flattened", False):  # use_orig_params=True: views of a FlatParameter's shard
            raise LayoutError(f"parameter {name!r} belongs to an FSDP1 module (FullyShardedDataParallel with "
                              "use_orig_params=True: each rank's view holds its part of a flattened shard, which "
                              "looks like a whole replicated tensor); norms per parameter need FSDP2 (fully_shard) "
                              "or DDP")
        if hasattr(param, "ds_id") or hasattr(param, "ds_tensor"):
            raise LayoutError(f"parameter {name!r} is partitioned by DeepSpeed ZeRO, which this library's "
                              "ownership rule does not describe")


def _distributed_buffer_params(model: Any) -> Optional[set[int]]:
    """The ids of the parameters in the gradient buffers (dense and expert) of the Megatron DDP
    modules in ``model`` that use the distributed optimizer; None when it holds no such module."""
    found: Optional[set[int]] = None
    for module in model.modules() if isinstance(model, torch.nn.Module) else []:
        if not getattr(getattr(module, "ddp_config", None), "use_distributed_optimizer", False):
            continue
        found = found if found is not None else set()
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = getattr(module, name, None)  # attributes of Megatron's DDP (nn.Module.buffers is a method)
            for buffer in buffers if isinstance(buffers, (list, tuple)) else []:
                found.update(id(p) for p in getattr(buffer, "param_index_map", {}))
    return found
