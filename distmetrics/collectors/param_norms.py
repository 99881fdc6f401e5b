"""The parameter side of :class:`~distmetrics.collectors.norms.NormCollector`: parameter and
update norms from this rank's pieces of the parameters (the distributed optimizer's fp32 main
shards, Megatron's ``main_param``, a DTensor's local shard), the snapshot and diff around
``optimizer.step()``, the update's ratios, and the check that no rank owning parameters lacks
an update."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from ..grad_measurement import GradMeasurement, clip_coefficient, coefficient_value
from ..parallel import local_tensor
from ..plans import Plan, route_of
from ..tensor_norms import LOW_PRECISION, groups_of, per_tensor_norms

logger = logging.getLogger("distmetrics")

__all__ = ["ParamSide"]

_LACKS_UPDATE = "_norms/lacks_update"  # an internal lane: some rank owns parameters but measured no update
_CHUNK = 1 << 23  # bf16/fp16 elements whose update is taken in float32 at once: old and new, 64 MiB of float32
_CPU_CHUNK = 1 << 20  # on the CPU: old and new, 8 MiB of float32, which the cache holds (see _low_precision_updates)
_WHOLE_UP_TO = 1 << 10  # CPU tensors of more elements are taken in parts (tensor_norms): a call per tensor


_LAZY = torch.nn.parameter.UninitializedParameter
"""A lazy module's parameter before its first forward (``nn.LazyLinear``): its class until then."""


class ParamSide:
    """Methods of the norm collector that read the parameters (a mixin: the state is the
    collector's, set in its ``__init__``: ``grads``, ``layout``, ``snapshot_device``, the
    snapshot and update fields, the optimizer hooks and step counts)."""

    def snapshot(self, step: int) -> None:
        """Before an optimizer step of ``step``, a log step (or :data:`~.norms.FIRST_STEP`): copy the
        local shards, or, where an earlier optimizer step of the same step was diffed (a GAN's
        generator and critic, n_critic critic steps, a chained optimizer's parts), make the copy's fp32
        pieces, which hold that difference, the parameters before the first step again (+ P now:
        exact wherever the difference was), so that :meth:`diff` gives the whole step's update with
        no second copy. A copy not yet diffed (a step that raised) holds them as it is. The copy is kept
        past :meth:`diff` only where a step may hold several optimizer steps (:attr:`_keeps_copy`); with
        one optimizer that was not known at the step that first steps it twice, whose update is left out
        (said at its record) and measured whole from then on."""
        if self._snapshot is None and self._update is not None and self._update_step == step:
            self._repeats_seen = True  # the copy went at the first: this step's update would be its last part's
            self._update, self._update_step, self._dropped_step = None, None, step
        if self._dropped_step == step:
            return
        if self._snapshot is not None and self._snapshot_step == step:
            if self._diffed:
                self._diffed = False
                old = self._snapshot
                full = [i for (_, dtype), positions in groups_of(old).items() if dtype not in LOW_PRECISION
                        for i in positions]  # bf16/fp16 pieces are kept as copied (:func:`_low_precision_updates`)
                if full:
                    now = self._param_pieces(self._snapshot_plan)
                    torch._foreach_add_([old[i] for i in full], [self._here(now[i]) for i in full])
            return
        self._snapshot = None  # one copy at a time
        plan = self.grads.plans.model_plan()
        locals_ = self._param_pieces(plan)
        if self.snapshot_device == "cpu":
            self._snapshot = [t.to("cpu", copy=True) for t in locals_]
        else:
            self._snapshot = torch._foreach_mul(locals_, 1.0)
        self._snapshot_step, self._snapshot_plan, self._diffed = step, plan, False

    def diff(self) -> None:
        """After an optimizer step: per-bucket ‖P_new − P_old‖² over the snapshot's parameters, P_old
        those before the step's first optimizer step (:meth:`snapshot`), so the update is the sum of
        the step's optimizer steps whatever their number and order. The copy is kept until
        ``monitor.step``, its fp32 pieces holding the difference."""
        if self._snapshot is None or self._diffed:
            return
        plan, old = self._snapshot_plan, self._snapshot
        new = [self._here(t) for t in self._param_pieces(plan)]
        groups = groups_of(old)
        if any(dtype in LOW_PRECISION for _, dtype in groups):
            updates, groups = _low_precision_updates(old, new, groups), None
        else:  # fp32 parameters or fp32 main copies: the difference in place, in their dtype
            torch._foreach_sub_(old, new)
            updates = old
        self._diffed = True
        self._update = self._bucket_squares(plan, updates, groups)
        self._update_step = self._snapshot_step
        self._update_plan = plan  # parameters frozen or added before the log step do not rename its buckets
        if not self._keeps_copy:  # one optimizer stepping once a step: the copy goes now, not held through
            self._snapshot = self._snapshot_plan = None  # a forward and backward before monitor.step

    @property
    def _keeps_copy(self) -> bool:
        """Whether the copy is kept until ``monitor.step`` for further optimizer steps of the step:
        several optimizers are attached (a GAN's, a chained optimizer's parts), or one stepped twice
        in a step before."""
        return self._steps.count > 1 or self._repeats_seen

    def _here(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` where the snapshot lives (``update_norm_snapshot``)."""
        return piece.to("cpu") if self.snapshot_device == "cpu" else piece

    def _lacks_update(self, missing: bool) -> float:
        """This rank owns trainable parameters but measured no update for the log step: no optimizer
        was given to its Monitor, or none given stepped between the last two ``monitor.step`` calls
        (replaced by a new one, skipped by a GradScaler while earlier steps of the interval stepped,
        or raised): 2.0; 1.0 where that ``monitor.step`` was given ``skipped=True`` (the lack is
        explained); else 0.0. An update measured for a predicted log step that was not one is no
        lack: every rank missed it alike."""
        if not missing or (self._steps.attached and self._stepped and not self._skipped_step):
            return 0.0  # (a fused optimizer steps on a skipped step too: its update left out is said as skipped)
        plan = self.grads.plans.model_plan()
        pieces = self._param_pieces(plan)
        if not pieces:
            return 0.0
        route = self._param_route(plan, pieces[0].device)  # a replica rank 0 counts for (DDP) lacks nothing
        if not (route.every or route.owned_buckets.ids):  # on the host: no device sync
            return 0.0
        return 1.0 if self._skipped_step else 2.0

    def _drop_partial_update(self, metrics: dict[str, Any], step: int) -> None:
        """Some rank lacks an update (:meth:`_lacks_update`): the others' sum is not the model's
        update, so the record has no ``update_norm`` (a pipeline stage, or a rank, not given the
        optimizer wrote the other stages' part as the whole); said once, naming a rank."""
        rank = metrics.pop(f"{_LACKS_UPDATE}/max_rank", None)
        lacks = metrics.pop(_LACKS_UPDATE, 0)
        if not lacks:
            return
        for key in [k for k in metrics if k == "update_norm" or k.startswith("update_norm/")]:
            del metrics[key]
        if lacks < 2:  # every rank that lacks it was given skipped=True: said apart, once
            if not self._warned_skipped_update and self.layout.says_once:
                self._warned_skipped_update = True
                logger.warning("distmetrics: the record of step %d has no update_norm: its monitor.step was given "
                               "skipped=True (the optimizer skipped the step, as a loss scaler does on an overflow). "
                               "Said once; a lack that no skipped step explains is said apart", step)
            return
        if self._warned_update or not self.layout.says_once:
            return
        self._warned_update = True
        why = ("No optimizer was given to its Monitor (Monitor(optimizer=...) or "
               "monitor.attach_megatron_optimizer(optimizer), on every rank that holds parameters), or none "
               "given stepped between this monitor.step and the one before (skipped by a GradScaler, raised, "
               "or replaced: attach the new one)")
        if self.sync.open_at is not None and self.sync.held_open():  # the window said, and open at this step
            window = "monitor.step came inside a gradient-accumulation window, before the optimizer's step (said above)"
            why = window if self._steps.attached else f"{window}. {why}"
        logger.warning("distmetrics: the record of step %d has no update_norm (nor any later record where it is so): "
                       "rank %s owns trainable parameters but measured no update in the step. %s",
                       step, "?" if rank is None else int(rank), why)

    def _ratios(self, metrics: dict[str, Any], grad: Optional[GradMeasurement], keys: list[str]) -> None:
        """relative_update_norm = update/param; effective_lr_ratio = update/‖clipped grad‖ (p = 2),
        for the update-norm ``keys`` (the total and every subtree); no total effective_lr_ratio where
        the last measurement is a part's (a clip per network: :meth:`NormCollector._keep`)."""
        coef = 1.0
        if grad is not None and grad.coef is not None:  # the clip's coefficient, from the reduced total on the
            # host where the record has it: reading the tensor back is a device sync on a GPU
            total = metrics.get("grad_norm")
            if isinstance(total, float) and grad.max_norm is not None:
                exact = torch.tensor(total, dtype=torch.float64)  # host tensors: no device sync
                returned = exact.to(grad.coef.dtype)
                coef = coefficient_value(clip_coefficient(returned, exact, grad.max_norm, grad.megatron))  # the clip's
            else:
                coef = coefficient_value(grad.coef)
        same_norm = grad is None or grad.norm_type == 2.0
        uncovered = self._uncovered(grad)
        for key in keys:
            suffix = key[len("update_norm"):]
            param = metrics.get(f"param_norm{suffix}")
            if param:
                metrics[f"relative_update_norm{suffix}"] = metrics[key] / param
            clipped = (metrics.get(f"grad_norm{suffix}") or 0.0) * abs(coef)  # max_norm < 0 flips the sign
            # none where the update holds several steps of one optimizer (n_critic) but the gradient is the last's
            whole = not self._repeated and (suffix or grad is None or not grad.partial) and self._last_grad_own \
                and suffix[1:] not in uncovered and not (grad is not None and grad.inside_step)
            # none where the clip zeroed the gradient (max_norm 0) or the norm is not finite (inf x a coefficient
            # of 0 is NaN; an inf norm, by a sum of squares past float32 too, leaves no ratio to tell)
            if clipped and math.isfinite(clipped) and same_norm and whole:
                metrics[f"effective_lr_ratio{suffix}"] = metrics[key] / clipped

    def _uncovered(self, grad: Optional[GradMeasurement]) -> frozenset:
        """The modules (and ``""``, the whole model) whose update holds parameters the last measurement
        did not measure (a clip of a part, or one per parameter group): their ratio would be a whole
        update over a part's gradient (5x too high for a decay group's module over its bias group's).
        Worked out once per pair of plans."""
        update = self._update_plan
        if grad is None or grad.plan is None or update is None or grad.plan is update:
            return frozenset()
        key = (grad.plan.signature, update.signature)
        if self._coverage[0] != key:
            measured = {id(p) for p in grad.plan.params}
            out: set = set()
            for p, bucket in zip(update.params, update.bucket_of.tolist()):
                if id(p) not in measured:
                    parts = update.buckets[bucket].split(".")
                    out.update(".".join(parts[:depth]) for depth in range(len(parts) + 1))  # "" and each ancestor
            self._coverage = (key, frozenset(out))
        return self._coverage[1]

    def _param_pieces(self, plan: Plan) -> list[torch.Tensor]:
        """This rank's piece of every parameter: the distributed optimizer's fp32 main shard,
        the fp32 main copy Megatron's mixed-precision optimizer updates (``main_param``: it
        copies it into the 16-bit parameter only after the inner step), a DTensor's local
        shard, or the parameter."""
        shards = self.grads.shards
        out = []
        for p in plan.params:
            main = shards.main_shard(p) if shards is not None else None
            if main is None and not getattr(p, "main_param_sharded", False):
                main = getattr(p, "main_param", None)
            if main is None and isinstance(p, _LAZY):  # a lazy module's before its first forward: no value yet
                main = torch.empty(0, dtype=p.dtype, device=p.device)
            out.append(main.detach() if main is not None else local_tensor(p.detach()))
        return out

    def _param_route(self, plan: Plan, device: torch.device) -> Any:
        """The params' :class:`~distmetrics.plans.Route` on ``device`` (cached)."""
        route = plan.param_routes.get(device)
        if route is None:
            weights = [self.grads.owns(p, n, p, plan) for p, n in zip(plan.params, plan.names)]
            route = plan.param_routes[device] = route_of(plan, list(range(len(plan.params))), weights, device)
        return route

    def _bucket_squares(self, plan: Plan, tensors: list[torch.Tensor], groups: Optional[dict] = None) -> torch.Tensor:
        """Per-bucket Σ w·‖t‖² for tensors laid out like the params (params or their updates);
        ``groups``: their :func:`~distmetrics.tensor_norms.groups_of`, where known."""
        device = tensors[0].device if tensors else torch.device("cpu")
        route = self._param_route(plan, device)
        # log steps only: CPU tensors past 1024 elements in rows or blocks (float32 whole sums were 3.6e-6 off)
        norms = per_tensor_norms(tensors, 2.0, None, device, route.orders, groups, whole_up_to=_WHOLE_UP_TO)
        squares = norms * norms
        contrib = squares if route.every else torch.where(route.owned, squares, torch.zeros_like(squares))
        return torch.zeros(len(plan.buckets), dtype=torch.float64, device=device).index_add_(
            0, route.bucket_idx, contrib)


def _low_precision_updates(old: list[torch.Tensor], new: list[torch.Tensor], groups: dict) -> list[torch.Tensor]:
    """Every piece's update ``old[i] − new[i]``: in place for fp32 pieces; for bf16/fp16 ones
    (a model cast with ``.to(torch.bfloat16)``, FSDP2 or DDP without a mixed-precision policy) the
    norm of the difference taken in float32, as a 1-element tensor (its norm is that norm). In
    their own dtype the difference rounds every element where old and new differ by more than a
    factor of 2 (~1e-5 relative on an AdamW step), and an fp16 difference past 65504 is inf. The
    old and new pieces of a chunk are upcast into two float32 buffers of at most :data:`_CHUNK`
    elements (:data:`_CPU_CHUNK` on the CPU), reused for every chunk (a tensor split where longer),
    and subtracted there in one operation: no float32 copy of the model beside the snapshot, no
    copy besides the upcast, no operation per piece but the upcast's and the norm's. Buffers that
    the CPU's cache holds are reused warm, where the fresh pages of large ones cost more than the
    work (on the CPU, 2^20 elements took 1.5-1.8x less time than 2^24 for 8 x 8M, 200 x 300k and
    2000 x 4096 bf16 elements)."""
    updates = list(old)
    for (device, dtype), positions in groups.items():
        if dtype not in LOW_PRECISION:
            torch._foreach_sub_([old[i] for i in positions], [new[i] for i in positions])
            continue
        most = _CPU_CHUNK if device.type == "cpu" else _CHUNK
        olds, news = torch.empty((2, min(most, sum(old[i].numel() for i in positions))), dtype=torch.float32,
                                 device=device)
        pieces: dict[int, list[torch.Tensor]] = {}  # position -> its pieces' update norms (0-d, float64)
        for chunk in _chunks(old, new, positions, most):
            sizes = [o.numel() for _, o, _ in chunk]
            size = sum(sizes)
            torch._foreach_copy_(list(olds[:size].split(sizes)), [o for _, o, _ in chunk])
            torch._foreach_copy_(list(news[:size].split(sizes)), [n for _, _, n in chunk])
            olds[:size].sub_(news[:size])
            # each piece past 1024 elements in rows (a float32 sum of a 32k-element update was 1.3e-6 off)
            norms = per_tensor_norms(list(olds[:size].split(sizes)), 2.0, None, device,
                                     whole_up_to=_WHOLE_UP_TO).split(1)
            for (i, _, _), norm in zip(chunk, norms):
                pieces.setdefault(i, []).append(norm)
        for i, parts in pieces.items():  # a tensor in several pieces: the norm of their norms
            updates[i] = parts[0] if len(parts) == 1 else torch.cat(parts).norm().reshape(1)
    return updates


def _chunks(old: list[torch.Tensor], new: list[torch.Tensor], positions: list[int], most: int):
    """Lists of (position, flat piece of old, the same piece of new), at most ``most`` elements each."""
    chunk: list[tuple] = []
    size = 0
    for i in positions:
        flat_old, flat_new = old[i].reshape(-1), new[i].reshape(-1)
        whole = flat_old.numel() <= most  # the usual case: no slicing
        for start in range(0, max(flat_old.numel(), 1), most):
            piece = flat_old if whole else flat_old[start:start + most]
            if chunk and size + piece.numel() > most:
                yield chunk
                chunk, size = [], 0
            chunk.append((i, piece, flat_new if whole else flat_new[start:start + most]))
            size += piece.numel()
    if chunk:
        yield chunk
