"""What ZeRO's two halves share: the bucket (a flat group of parameters split into one equal
shard per rank), the collectives over flat tensors, and the pinned host buffers of offload.

A bucket never mixes optimizer parameter groups, so that a shard belongs to one group (weight
decay and the like stay per group). Who fills which field:
- `distributed.sharding` (stage 3, a transform of the model): `shard`, `full`, `full_views`,
  `unit`: the parameters' data lives in `full` only while their unit is gathered;
- `distributed.zero` (the optimizer side, every stage): stages 0-2 make `flat_param` and take a
  view of it as `shard`; every stage fills the gradient fields and `cpu_shard` under offload.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from memfit.distributed.flat import FlatLayout

# one piece per rank gathered into, or reduced and scattered from, one flat tensor: torch 2.13
# names these *_single (the older names, all torch 2.11 has, warn there)
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def grad_hook_of(method: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook that calls the bound `method` while its object lives. A hook
    holding the object itself would keep it, its buckets and the model alive forever: the
    parameter keeps the hook in C++, where Python's garbage collector cannot see the cycle (a
    freed trainer's flat buffers stayed allocated until the process ended)."""
    ref = weakref.WeakMethod(method)

    def hook(param: Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


class Bucket:
    def __init__(self, params: list[Tensor], group_index: int, world_size: int, rank: int) -> None:
        self.params = params
        self.group_index = group_index
        self.layout = FlatLayout.of(params, world_size)
        self.start, self.end = self.layout.shard_bounds(rank)
        self.flat_param: Tensor | None = None  # stages 0-2: all the parameters, fp32
        self.full: Tensor | None = None  # stage 3: all the parameters, param_dtype, while gathered
        self.full_views: list[Tensor] = []  # stage 3: the parameters' data, views of full
        self.shard: Tensor | None = None  # the fp32 values the optimizer updates (this rank's)
        self.cpu_shard: Tensor | None = None  # offload: the fp32 master copy the optimizer steps
        self.grad: Tensor | None = None  # full gradients (stages 0, 1; stages 2, 3 in flight)
        self.grad_views: list[Tensor] = []  # stages 0, 1: the parameters' .grad
        self.shard_grad: Tensor | None = None  # this rank's averaged gradient (stages 1-3)
        self.arrived = 0
        self.launched = False  # its collective has started in this backward
        self.work = None
        self.reduced: Tensor | None = None  # output of a collective into a staging tensor
        self.offloaded = False  # offload: its final gradient of this step is copied to the host
        self.unit = None  # stage 3: the unit (distributed.sharding) it is gathered with


class HostBuffers:
    """fp32 CPU buffers for offload, pinned (page-locked, for asynchronous copies) when CUDA is
    there. torch's pinned allocator rounds every allocation up to a power of two, which for
    buckets of arbitrary sizes costs up to 2x (measured: 22 GiB more host memory for
    llama-2-7b's optimizer offload), so buffers are carved out of slabs whose sizes are powers
    of two, growing from 64 MiB to 1 GiB."""

    MIN_SLAB, MAX_SLAB = 1 << 24, 1 << 28  # fp32 elements

    def __init__(self) -> None:
        self.pin = torch.cuda.is_available()
        self.slab: Tensor | None = None
        self.used = 0

    def empty(self, numel: int) -> Tensor:
        if not self.pin:
            return torch.empty(numel)
        if self.slab is None or self.used + numel > self.slab.numel():
            size = max(self.MIN_SLAB, 2 * self.slab.numel() if self.slab is not None else 0)
            size = min(self.MAX_SLAB, size)
            if numel > size:  # larger than a slab: its own allocation
                return torch.empty(numel, pin_memory=True)
            self.slab, self.used = torch.empty(size, pin_memory=True), 0
        self.used += numel
        return self.slab[self.used - numel : self.used]

    def copy(self, tensor: Tensor) -> Tensor:
        return self.empty(tensor.numel()).copy_(tensor.detach().reshape(-1))


def free_storage(tensor: Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def group_info(process_group: dist.ProcessGroup | None) -> tuple[bool, int, int]:
    """(distributed, world size, rank) of `process_group` (None: the default group, if any)."""
    if not dist.is_initialized():
        return False, 1, 0
    return True, dist.get_world_size(process_group), dist.get_rank(process_group)
