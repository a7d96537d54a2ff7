"""ZeRO stage 3 as a transform of the model: each unit's parameters sharded across the ranks of
a process group, gathered for the unit's forward and backward and released after them
(Rajbhandari et al. 2020, "ZeRO", section 5.3; the role of FSDP's `fully_shard`).

`shard_parameters(model, units=..., param_groups=...)` is applied LAST of the engine's
transforms (activation checkpointing, then torch.compile, then sharding), like torchtitan's
`parallelize_llama`: its hooks are module hooks around each unit's call, outside a compiled or
checkpointed forward, so neither has to know about them. The optimizer side
(`distributed.zero.ZeroOptimizer(stage=3, sharded=...)`) then reduce-scatters the gradients into
the same shards and steps them.

Layout. One bucket per unit (a module given in `units`, e.g. a transformer block) and parameter
group; what no unit holds forms a last, root unit. Each rank keeps only its fp32 shard of each
bucket (in pinned host memory with `offload_params`). The parameters' storage is a view of a
`param_dtype` buffer (bf16 under bf16 autocast, so the matmuls take it as it is and autocast
caches no copies) whose memory exists only while the unit is gathered: its storage is resized to
the full size, all-gathered into from the shards, and resized to 0 when released.

Schedule. A unit is gathered in its forward pre-hook and released after its forward; gathered
again when the gradient of its output arrives in backward (the recompute of activation
checkpointing then finds it gathered) and released once all its parameters' gradients are in. The
next unit, in forward order or backward order, is gathered ahead (one unit of prefetch), so its
all-gather overlaps the current unit's compute. The root unit stays gathered from the start of
forward to the end of backward. Without a grad-enabled forward (evaluation) units are released
right after their forward.

Parameters this transform leaves alone:
- frozen ones (requires_grad=False: a LoRA base later) are in no parameter group, so in no bucket:
  they stay whole on every rank, in their own dtype. Sharding them is a bucket that is gathered
  and released like the others but has no gradient and no optimizer shard (not built yet).
- trainable parameters must be fp32 (memfit's master weights): the shard is what the optimizer
  steps. A non-fp32 trainable parameter (a bf16 adapter) gets its own bucket dtype in stage 0
  (see distributed.zero); sharding it needs an fp32 master shard beside it (not built yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_flatten

from memfit.distributed.buckets import (
    Bucket,
    HostBuffers,
    all_gather,
    free_storage,
    grad_hook_of,
    group_info,
)

__all__ = ["ShardedParameters", "shard_parameters"]


class Unit:
    """The buckets gathered and released together (one module's parameters)."""

    def __init__(self, index: int, buckets: list[Bucket], root: bool) -> None:
        self.index = index
        self.buckets = buckets
        self.root = root
        self.num_params = sum(len(b.params) for b in buckets)
        self.arrived = 0  # parameters whose gradient is in, this backward
        self.gathered = False
        self.works: list = []  # all-gathers in flight into the buckets' full buffers
        self.sends: list[Tensor] = []  # their inputs, kept alive until they finish
        self.in_backward = False


class ShardedParameters:
    """The stage-3 sharding of a model's trainable parameters (see the module docstring).
    `buckets` are what `ZeroOptimizer(stage=3, sharded=self)` reduces into and steps; outside a
    step the parameters hold no memory: `summon_full_params()` gives them their fp32 values."""

    def __init__(
        self,
        units: Sequence[nn.Module],
        root: nn.Module,
        param_groups: Sequence[Sequence[Tensor]],
        *,
        process_group: dist.ProcessGroup | None = None,
        param_dtype: torch.dtype = torch.float32,
        offload_params: bool = False,
    ) -> None:
        self.distributed, self.world_size, self.rank = group_info(process_group)
        self.group = process_group
        self.param_dtype = param_dtype
        self.offload_params = offload_params
        self.host = HostBuffers()
        group_of = {}
        for index, params in enumerate(param_groups):
            for param in params:
                if param.requires_grad:
                    if param.dtype != torch.float32:
                        raise ValueError(
                            "ZeRO-3 shards fp32 trainable parameters (memfit's master weights), "
                            f"got {param.dtype}"
                        )
                    group_of[id(param)] = index
        if not group_of:
            raise ValueError("ZeRO-3 found no trainable parameters to shard")
        self.device = next(p for params in param_groups for p in params).device
        self.buckets: list[Bucket] = []
        self.units: list[Unit] = []
        for index, members in enumerate(_unit_params(units, root, group_of)):
            buckets = []
            for group_index in sorted({group_of[id(p)] for p in members}):
                chunk = [p for p in members if group_of[id(p)] == group_index]
                bucket = Bucket(chunk, group_index, self.world_size, self.rank)
                self._bind(bucket)
                buckets.append(bucket)
                self.buckets.append(bucket)
            unit = Unit(index, buckets, root=index == len(units))
            for bucket in buckets:
                bucket.unit = unit
            self.units.append(unit)
        self._unit_of = {id(p): b.unit for b in self.buckets for p in b.params}
        for module, unit in zip([*units, root], self.units, strict=True):
            module.register_forward_pre_hook(lambda m, args, unit=unit: self._pre_forward(unit))
            module.register_forward_hook(
                lambda m, args, out, unit=unit: self._post_forward(unit, out)
            )
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(grad_hook_of(self._on_grad))
        self._callback_queued = False

    def _bind(self, bucket: Bucket) -> None:
        """Keep this rank's fp32 shard; the parameters become views of a param_dtype buffer
        released at once (its storage has no memory until the unit is gathered)."""
        shard = torch.zeros(bucket.layout.shard_numel, device=self.device)  # padding stays zero
        for piece in bucket.layout.pieces(self.rank):  # this rank's slices of the parameters
            values = bucket.params[piece.index].detach().reshape(-1)
            shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                values[piece.param_start : piece.param_start + piece.numel]
            )
        if self.offload_params:
            bucket.shard = bucket.cpu_shard = self.host.copy(shard)
        else:
            bucket.shard = shard
        bucket.full = torch.empty(
            bucket.layout.padded_numel, dtype=self.param_dtype, device=self.device
        )
        bucket.full_views = [
            view.view(param.shape)
            for param, view in zip(bucket.params, bucket.layout.views(bucket.full), strict=True)
        ]  # made while the storage has memory (a view of a released one cannot be made)
        for param, view in zip(bucket.params, bucket.full_views, strict=True):
            param.data = view
        free_storage(bucket.full)

    # -- gathering and releasing ---------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        """Start gathering `unit` (no-op if gathered): its buckets' full buffers get memory and
        the shards are all-gathered into them (cast to param_dtype first)."""
        if unit.gathered:
            return
        unit.gathered = True
        for bucket in unit.buckets:
            full = bucket.full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            # offload: the fp32 shard comes up from pinned memory asynchronously and is cast on
            # the GPU (a copy that also converts would convert on the CPU, into pageable memory,
            # and block this thread until it is done)
            send = bucket.shard.to(self.device, non_blocking=True).to(self.param_dtype)
            if self.distributed:
                unit.sends.append(send)
                unit.works.append(all_gather(full, send, group=self.group, async_op=True))
            else:
                full.copy_(send)

    def _wait_gathered(self, unit: Unit) -> None:
        self._gather(unit)
        for work in unit.works:
            work.wait()
        unit.works.clear()
        unit.sends.clear()

    def _release(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        self._wait_gathered(unit)  # an all-gather still writing must finish first
        for bucket in unit.buckets:
            free_storage(bucket.full)
        unit.gathered = False

    def release_all(self) -> None:
        """Release every unit (e.g. after a forward that no backward follows)."""
        for unit in self.units:
            self._release(unit)
            unit.in_backward, unit.arrived = False, 0

    def _pre_forward(self, unit: Unit) -> None:
        if unit.root:
            self._gather(unit)
            self._wait_gathered(unit)
            if len(self.units) > 1:
                self._gather(self.units[0])
            return
        self._wait_gathered(unit)
        if unit.index + 1 < len(self.units) - 1:  # the next unit (the root is already there)
            self._gather(self.units[unit.index + 1])

    def _post_forward(self, unit: Unit, output) -> None:
        if not torch.is_grad_enabled():
            self._release(unit)  # evaluation: no backward will need it
            return
        if unit.root:
            return  # kept for backward, which starts with the root's last layers
        self._release(unit)
        tensors, _ = tree_flatten(output)
        for tensor in tensors:
            if isinstance(tensor, Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        """The gradient of the unit's output is in: its backward (and recompute) is next."""
        if unit.in_backward:
            return
        unit.in_backward = True
        self._queue_finish()
        self._wait_gathered(unit)
        if unit.index > 0:
            self._gather(self.units[unit.index - 1])

    def _on_grad(self, param: Tensor) -> None:
        """A parameter's gradient is in; once all of its unit's are, the unit is released."""
        self._queue_finish()
        unit = self._unit_of[id(param)]
        unit.arrived += 1
        if unit.arrived == unit.num_params:
            self._release(unit)

    def _queue_finish(self) -> None:
        if not self._callback_queued and torch._C._current_graph_task_id() != -1:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: release what is still gathered (the root, units whose parameters got
        no gradient on this rank)."""
        self._callback_queued = False
        self.release_all()

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Inside, every parameter holds its full fp32 value (read-only: changes are not written
        back). Memory: the whole model in fp32 on every rank."""
        for unit in self.units:
            self._release(unit)
        for bucket in self.buckets:
            flat = torch.empty(bucket.layout.padded_numel, device=self.device)
            shard = bucket.shard.to(self.device)
            if self.distributed:
                all_gather(flat, shard, group=self.group)
            else:
                flat.copy_(shard)
            for param, view in zip(bucket.params, bucket.layout.views(flat), strict=True):
                param.data = view.view(param.shape)
        try:
            yield
        finally:
            for bucket in self.buckets:
                for param, view in zip(bucket.params, bucket.full_views, strict=True):
                    param.data = view

    def parameter_bytes(self) -> int:
        """Bytes of parameter shards this rank holds on its device (0 with offload_params)."""
        return 0 if self.offload_params else sum(b.shard.numel() * 4 for b in self.buckets)


def shard_parameters(
    model: nn.Module,
    *,
    units: Sequence[nn.Module],
    param_groups: Sequence[dict] | Sequence[Sequence[Tensor]],
    process_group: dist.ProcessGroup | None = None,
    param_dtype: torch.dtype = torch.float32,
    offload_params: bool = False,
) -> ShardedParameters:
    """Shard `model`'s trainable parameters across `process_group` (a DeviceMesh's data-parallel
    dimension; None: the default group; no process group: one rank, for parameter offload), one
    bucket per unit of `units` (in forward order) and per parameter group (`param_groups` as given
    to the optimizer: dicts with "params", or lists of tensors), the rest with `model` as the root
    unit. Apply it after activation checkpointing and compile. See the module docstring."""
    groups = [g["params"] if isinstance(g, dict) else g for g in param_groups]
    return ShardedParameters(
        units,
        model,
        [list(g) for g in groups],
        process_group=process_group,
        param_dtype=param_dtype,
        offload_params=offload_params,
    )


def _unit_params(
    units: Sequence[nn.Module], root: nn.Module, group_of: dict[int, int]
) -> list[list[Tensor]]:
    """The trainable parameters of each unit, then those of the root that no unit holds; each
    parameter belongs to the first unit that holds it."""
    seen: set[int] = set()
    found = []
    for module in (*units, root):
        members = []
        for param in module.parameters():
            if id(param) in group_of and id(param) not in seen:
                seen.add(id(param))
                members.append(param)
        found.append(members)
    missing = set(group_of) - seen
    if missing:
        raise ValueError(f"{len(missing)} parameters to optimize are not in root or any unit")
    for members, module in zip(found[:-1], units, strict=True):
        if not members:
            raise ValueError(f"unit {type(module).__name__} has no parameters of its own")
    return found
