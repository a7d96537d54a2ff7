"""ZeRO stages 0-2 over flat buckets (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", sections 5.1-5.2).

memfit keeps its parameters in fp32 (they are the master weights; autocast casts them per matmul),
so per rank, with P parameters, N ranks and AdamW:

    stage 0 (data parallel):  params 4P + grads 4P + optimizer 8P
    stage 1 (optimizer):      params 4P + grads 4P + optimizer 8P/N  (+ fp32 grad shard 4P/N)
    stage 2 (+ gradients):    params 4P + grads 4P/N + optimizer 8P/N (+ one bucket in flight)

Layout. Parameters are grouped into buckets of about `bucket_numel` elements, in reverse order
(the order backward produces their gradients), never mixing optimizer parameter groups (so that a
shard belongs to one group: weight decay and the like stay per group). Each bucket is a
`FlatLayout` split into N equal shards; the parameters' storage becomes views of the bucket's flat
fp32 buffer, so that gathering updated shards into that buffer updates the parameters in place.
The wrapped torch optimizer sees one tensor per bucket: this rank's shard (stage 0: the whole
bucket), a view of the flat buffer, so its step updates the parameters directly.

Communication, overlapped with backward: a hook fires as each parameter's gradient is accumulated;
when a bucket's gradients are all in, its collective starts asynchronously while backward goes on
with earlier layers. Stage 0 all-reduces the bucket (average), stage 1 reduce-scatters it into
this rank's fp32 gradient shard, stage 2 does the same but the full-size gradient exists only for
the bucket in flight: each parameter's gradient is copied into the bucket's staging buffer and
freed at once. At the end of backward every collective is waited for (one autograd callback). With
`reduce_dtype=torch.bfloat16` the collectives carry bf16 copies of the fp32 buckets (half the
bytes) and their results are added back into the fp32 buffers.

Gradient accumulation: stages 0 and 1 keep full gradients and accumulate locally; inside
`no_sync()` nothing is communicated and the last micro-step communicates once. Stage 2 cannot keep
full gradients without giving up its saving, so it reduce-scatters every micro-step and adds into
the fp32 shard (communication x grad_accum, memory 4P/N).

Offload (`offload=True`, ZeRO-Offload, Ren et al. 2021): the optimizer states and an fp32 master
copy of each shard live in (pinned) CPU memory and the optimizer steps there (torch's vectorized
AdamW over the flat shard); the averaged gradient shard is copied to the host before the step and
the updated shard back after it. It also runs without a process group, on one GPU. Not yet: the
device-to-host copies overlapped with backward (they run at `step`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from memfit.distributed.flat import FlatLayout

__all__ = ["ZeroOptimizer", "zero_state_bytes"]


class _Bucket:
    def __init__(self, params: list[Tensor], group_index: int, world_size: int, rank: int) -> None:
        self.params = params
        self.group_index = group_index
        self.layout = FlatLayout.of(params, world_size)
        device = params[0].device
        self.flat_param = self.layout.empty(torch.float32, device)
        self.layout.pack([p.detach() for p in params], self.flat_param)
        for param, view in zip(params, self.layout.views(self.flat_param), strict=True):
            param.data = view.view(param.shape)
        self.start, self.end = self.layout.shard_bounds(rank)
        self.shard: Tensor | None = None  # what the optimizer updates (ZeroOptimizer._shard_param)
        self.cpu_shard: Tensor | None = None  # offload: the fp32 master copy the optimizer steps
        self.grad: Tensor | None = None  # full fp32 gradients (stages 0, 1; stage 2 in flight)
        self.grad_views: list[Tensor] = []  # stages 0, 1: the parameters' .grad
        self.shard_grad: Tensor | None = None  # this rank's averaged gradient (stages 1, 2)
        self.arrived = 0
        self.launched = False  # its collective has started in this backward
        self.work = None
        self.reduced: Tensor | None = None  # stage 2: output of the reduce-scatter in flight


class ZeroOptimizer:
    """Shards the states of `optimizer_factory(groups)` across the ranks of `process_group`.

    param_groups: like a torch optimizer's (dicts with "params" and per-group options);
    optimizer_factory: builds the torch optimizer from groups whose "params" are the flat shards
    (e.g. `lambda groups: torch.optim.AdamW(groups, lr=1e-3)`); `.optimizer` is it, for LR
    schedulers. Call `backward` as usual, then `clip_grad_norm_` (optional), `step`, `zero_grad`.
    """

    def __init__(
        self,
        param_groups: Sequence[dict],
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        stage: int,
        process_group: dist.ProcessGroup | None = None,
        bucket_numel: int = 1 << 24,
        offload: bool = False,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer takes stages 0, 1 and 2, got {stage}")
        self.distributed = dist.is_initialized()
        if not self.distributed and not offload:
            raise ValueError(
                "ZeRO needs a process group: launch with torchrun --nproc_per_node N "
                "-m memfit train ... (on one GPU, --offload optimizer works without one)"
            )
        self.stage = stage
        self.offload = offload
        self.reduce_dtype = reduce_dtype
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.sync = True
        self.buckets: list[_Bucket] = []
        shard_groups = []
        for group_index, group in enumerate(param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            for param in params:
                if param.dtype != torch.float32:
                    raise ValueError(
                        f"ZeRO shards fp32 parameters (memfit's master weights), got {param.dtype}"
                    )
            options = {k: v for k, v in group.items() if k != "params"}
            shards = []
            for chunk in _chunks(list(reversed(params)), bucket_numel):
                bucket = _Bucket(chunk, group_index, self.world_size, self.rank)
                self.buckets.append(bucket)
                shards.append(self._shard_param(bucket))
            shard_groups.append({"params": shards, **options})
        # parameter -> (its bucket, its index there), looked up by every gradient hook
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            self._init_grads(bucket)
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_grad)
        self._callback_queued = False
        if offload:
            # ZeRO-Offload: the optimizer steps fp32 copies of the shards in (pinned) CPU memory
            pin = torch.cuda.is_available() and self.buckets and self.buckets[0].flat_param.is_cuda
            for bucket in self.buckets:
                bucket.cpu_shard = (
                    bucket.shard.detach().to("cpu").pin_memory()
                    if pin
                    else (bucket.shard.detach().to("cpu", copy=True))
                )
                bucket.cpu_shard.grad = torch.zeros_like(bucket.cpu_shard)
            by_id = {id(b.shard): b.cpu_shard for b in self.buckets}
            shard_groups = [
                {**g, "params": [by_id[id(t)] for t in g["params"]]} for g in shard_groups
            ]
        self.optimizer = optimizer_factory(shard_groups)

    # -- layout --------------------------------------------------------------------------------

    def _shard_param(self, bucket: _Bucket) -> Tensor:
        """The tensor the wrapped optimizer updates for this bucket (one object, created once:
        its .grad is what the optimizer reads)."""
        if bucket.shard is None:
            whole = self.stage == 0
            bucket.shard = (
                bucket.flat_param if whole else bucket.flat_param[bucket.start : bucket.end]
            )
        return bucket.shard

    def _init_grads(self, bucket: _Bucket) -> None:
        shard = self._shard_param(bucket)
        if self.stage in (0, 1):
            bucket.grad = bucket.layout.empty(torch.float32, shard.device)
            bucket.grad_views = [
                view.view(param.shape)
                for param, view in zip(bucket.params, bucket.layout.views(bucket.grad), strict=True)
            ]
            for param, view in zip(bucket.params, bucket.grad_views, strict=True):
                param.grad = view  # autograd accumulates into it in place
        if self.stage == 0:
            shard.grad = bucket.grad
        else:
            bucket.shard_grad = torch.zeros_like(shard)
            shard.grad = bucket.shard_grad

    # -- communication -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the last one of an accumulation: stages 0 and 1 communicate nothing
        (stage 2 still reduce-scatters, see the module docstring)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _on_grad(self, param: Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, index = self._slot[id(param)]
        if self.stage < 2:
            view = bucket.grad_views[index]
            if param.grad is not view:  # someone set .grad to None (e.g. model.zero_grad())
                view.copy_(param.grad)
                param.grad = view
        if self.stage == 2:
            if bucket.grad is None:
                bucket.grad = bucket.layout.empty(torch.float32, param.device)
            offset = bucket.layout.offsets[index]
            bucket.grad[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
            param.grad = None  # the full-size gradient lives only in the bucket in flight
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched or (self.stage < 2 and not self.sync):
            return
        bucket.launched = True
        if not self.distributed:  # one process (single-GPU offload): the average is the gradient
            if self.stage == 1:
                bucket.shard_grad.copy_(bucket.grad)
            elif self.stage == 2:
                bucket.reduced = bucket.grad
            return
        # input: the fp32 bucket, or its reduce_dtype copy; output: where the optimizer reads
        # (stage 0 in place, stage 1 into the fp32 shard), else a staging tensor that
        # _finish_backward copies (stages 0, 1) or adds (stage 2, which accumulates) from
        low = self.reduce_dtype != torch.float32
        source = bucket.grad.to(self.reduce_dtype) if low else bucket.grad
        if self.stage == 0:
            bucket.reduced = source if low else None
            bucket.work = dist.all_reduce(
                source, op=dist.ReduceOp.AVG, group=self.group, async_op=True
            )
            return
        if self.stage == 1 and not low:
            target = bucket.shard_grad
        else:
            target = bucket.reduced = torch.empty(
                bucket.layout.shard_numel, dtype=self.reduce_dtype, device=source.device
            )
        bucket.work = dist.reduce_scatter_tensor(
            target, source, op=dist.ReduceOp.AVG, group=self.group, async_op=True
        )

    def _finish_backward(self) -> None:
        """End of backward: start what has not started (buckets with unused parameters), wait."""
        self._callback_queued = False
        for bucket in self.buckets:
            if self.stage == 2 and bucket.grad is None:
                continue  # no gradient reached this bucket in this backward
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if bucket.reduced is not None:  # the collective wrote a staging tensor
                if self.stage == 0:
                    bucket.grad.copy_(bucket.reduced)
                elif self.stage == 1:
                    bucket.shard_grad.copy_(bucket.reduced)
                else:
                    bucket.shard_grad.add_(bucket.reduced)
                bucket.reduced = None
            if self.stage == 2:
                bucket.grad = None
            bucket.arrived, bucket.launched = 0, False

    # -- optimizer -----------------------------------------------------------------------------

    def gradients(self) -> list[Tensor]:
        """The averaged gradients the optimizer will read, one flat tensor per bucket (this
        rank's shard in stages 1 and 2): for loss-scale unscaling and overflow checks."""
        return [b.grad if self.stage == 0 else b.shard_grad for b in self.buckets]

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the (averaged) gradients so that their global L2 norm is at most max_norm (no
        clipping when max_norm is 0 or inf); returns the norm before clipping, the same on every
        rank."""
        grads = self.gradients()
        total = torch.stack([g.float().square().sum() for g in grads]).sum()
        if self.stage >= 1 and self.distributed:  # each rank holds a disjoint shard
            dist.all_reduce(total, group=self.group)
        norm = total.sqrt()
        if 0 < max_norm < math.inf:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        if self.offload:
            for bucket, grad in zip(self.buckets, self.gradients(), strict=True):
                bucket.cpu_shard.grad.copy_(grad, non_blocking=True)
            if self.buckets and self.buckets[0].flat_param.is_cuda:
                torch.cuda.current_stream().synchronize()
        self.optimizer.step()
        if self.offload:
            for bucket in self.buckets:
                bucket.shard.copy_(bucket.cpu_shard, non_blocking=True)
        if self.stage >= 1 and self.distributed:
            for bucket in self.buckets:
                shard = bucket.flat_param[bucket.start : bucket.end].clone()
                dist.all_gather_into_tensor(bucket.flat_param, shard, group=self.group)

    def zero_grad(self) -> None:
        for grad in self.gradients():
            grad.zero_()
        if self.stage == 1:
            for bucket in self.buckets:
                bucket.grad.zero_()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states."""
        params = sum(b.flat_param.numel() * 4 for b in self.buckets)
        grads = sum(g.numel() * 4 for g in self.gradients())
        if self.stage == 1:
            grads += sum(b.grad.numel() * 4 for b in self.buckets)
        optimizer = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, Tensor) and t.dim() > 0
        )
        if self.offload:  # in CPU memory, with the master copies and their gradients
            cpu = optimizer + sum(2 * b.cpu_shard.numel() * 4 for b in self.buckets)
            return {"params": params, "grads": grads, "optimizer_states": 0, "cpu": cpu}
        return {"params": params, "grads": grads, "optimizer_states": optimizer}


def _chunks(params: list[Tensor], bucket_numel: int) -> Iterator[list[Tensor]]:
    chunk, size = [], 0
    for param in params:
        if chunk and size + param.numel() > bucket_numel:
            yield chunk
            chunk, size = [], 0
        chunk.append(param)
        size += param.numel()
    if chunk:
        yield chunk


def zero_state_bytes(
    num_params: int, stage: int, world_size: int, optimizer: str = "adamw"
) -> dict:
    """The ZeRO formulas of the module docstring, for comparison with `state_bytes` (which also
    counts the padding of each bucket, fewer than world_size elements per bucket)."""
    per_param = 8 if optimizer == "adamw" else 4
    shard = math.ceil(num_params / world_size)
    grads = {0: 4 * num_params, 1: 4 * num_params + 4 * shard, 2: 4 * shard}[stage]
    return {
        "params": 4 * num_params,
        "grads": grads,
        "optimizer_states": per_param * (num_params if stage == 0 else shard),
    }
