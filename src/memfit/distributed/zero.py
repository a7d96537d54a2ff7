"""ZeRO stages 0-3 over flat buckets (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5).

memfit keeps its parameters in fp32 (they are the master weights; autocast casts them per matmul),
so per rank, with P parameters, N ranks and AdamW:

    stage 0 (data parallel):  params 4P   + grads 4P   + optimizer 8P
    stage 1 (optimizer):      params 4P   + grads 4P   + optimizer 8P/N  (+ fp32 grad shard 4P/N)
    stage 2 (+ gradients):    params 4P   + grads 4P/N + optimizer 8P/N  (+ buckets in flight)
    stage 3 (+ parameters):   params 4P/N + grads 4P/N + optimizer 8P/N  (+ units gathered)

Layout. Parameters are grouped into buckets, never mixing optimizer parameter groups (so that a
shard belongs to one group: weight decay and the like stay per group). Each bucket is a
`FlatLayout` split into N equal shards. The wrapped torch optimizer sees one tensor per bucket:
this rank's fp32 shard (stage 0: the whole bucket), so its step updates that shard.
- Stages 0-2: buckets of about `bucket_numel` elements, in reverse order (the order backward
  produces their gradients). The parameters' storage becomes views of the bucket's flat fp32
  buffer and the optimizer's shard is a view of it too: gathering the updated shards into that
  buffer (stages 1, 2) updates the parameters in place.
- Stage 3: one bucket per unit (a module given in `units`, e.g. a transformer block) and
  parameter group; what no unit holds forms a last, root unit. Each rank keeps only its fp32
  shard. The parameters' storage is a view of a `param_dtype` buffer (bf16 under bf16 autocast,
  so the matmuls take it as it is and autocast caches no copies) whose memory exists only while
  the unit is gathered: its storage is resized to the full size, all-gathered into from the
  shards, and resized to 0 when released. A unit is gathered in its forward pre-hook and released
  after its forward; gathered again when the gradient of its output arrives in backward (the
  recompute of activation checkpointing then finds it gathered) and released once all its
  parameters' gradients are in. The next unit, in forward order or backward order, is gathered
  ahead (one unit of prefetch), so its all-gather overlaps the current unit's compute. The root
  unit stays gathered from the start of forward to the end of backward.

Communication, overlapped with backward: a hook fires as each parameter's gradient is accumulated;
when a bucket's gradients are all in, its collective starts asynchronously while backward goes on
with earlier layers. Stage 0 all-reduces the bucket (average), stage 1 reduce-scatters it into
this rank's fp32 gradient shard, stages 2 and 3 do the same but the full-size gradient exists
only for the buckets being filled or in flight: the parameters' gradients are copied into one
staging buffer and freed as the collective starts, and at most `_IN_FLIGHT` reduce-scatters are
outstanding (the oldest is waited for, added into the shard's gradient and its buffers freed,
before another starts). Their gradient shards exist from the first reduce-scatter of a step to
`zero_grad`, not in forward, when activations peak. At the end of backward every collective is
waited for (one autograd callback). With `reduce_dtype=torch.bfloat16` the collectives carry bf16
gradients (half the bytes) and their results are added back into the fp32 buffers.

Gradient accumulation: stages 0 and 1 keep full gradients and accumulate locally; inside
`no_sync()` nothing is communicated and the last micro-step communicates once. Stages 2 and 3
cannot keep full gradients without giving up their saving, so they reduce-scatter every
micro-step and add into the fp32 shard (communication x grad_accum, memory 4P/N); stage 3 also
gathers the parameters every micro-step.

Offload (ZeRO-Offload, Ren et al. 2021): with `offload="optimizer"` the optimizer states and an
fp32 master copy of each shard live in (pinned) CPU memory and the optimizer steps there (torch's
vectorized AdamW over the flat shard); the averaged gradient shard is copied to the host before
the step and the updated shard back after it. `offload="params"` (stage 3) also keeps the
parameter shards there only: a unit's all-gather starts with a host-to-device copy of the shard.
Both run without a process group, on one GPU. Each bucket's gradient is copied to the host, on
its own CUDA stream, as soon as it is final (after the last micro-step's reduction), so the copies
overlap the rest of backward; what the loss scaler's unscaling and clipping multiply the device
gradients by afterwards (`note_gradients_scaled`) is applied in the CPU step, by the fused AdamW's
own grad_scale (no extra pass over the host memory) or by a multiply.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_flatten

from memfit.distributed.flat import FlatLayout

__all__ = ["ZeroOptimizer", "zero_state_bytes"]

# one piece per rank gathered into, or reduced and scattered from, one flat tensor: torch 2.13
# names these *_single (the older names, all torch 2.11 has, warn there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_IN_FLIGHT = 1  # stages 2, 3: reduce-scatters outstanding at once (their buffers held)


class _Bucket:
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
        self.unit: _Unit | None = None  # stage 3: the unit it is gathered with


class _Unit:
    """Stage 3: the buckets gathered and released together (one module's parameters)."""

    def __init__(self, index: int, buckets: list[_Bucket], root: bool) -> None:
        self.index = index
        self.buckets = buckets
        self.root = root
        self.gathered = False
        self.works: list = []  # all-gathers in flight into the buckets' full buffers
        self.sends: list[Tensor] = []  # their inputs, kept alive until they finish
        self.in_backward = False


class ZeroOptimizer:
    """Shards the states of `optimizer_factory(groups)` across the ranks of `process_group`.

    param_groups: like a torch optimizer's (dicts with "params" and per-group options);
    optimizer_factory: builds the torch optimizer from groups whose "params" are the flat shards
    (e.g. `lambda groups: torch.optim.AdamW(groups, lr=1e-3)`); `.optimizer` is it, for LR
    schedulers. Call `backward` as usual, then `clip_grad_norm_` (optional), `step`, `zero_grad`.
    Stage 3 also takes `units` (the modules gathered one at a time, in forward order, e.g. the
    transformer blocks), `root` (the module whose forward runs them all, e.g. the model) and
    `param_dtype` (the dtype the parameters are gathered and computed in); outside a step the
    parameters hold no memory: `summon_full_params()` gives them their fp32 values for a while.
    """

    def __init__(
        self,
        param_groups: Sequence[dict],
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        stage: int,
        process_group: dist.ProcessGroup | None = None,
        bucket_numel: int = 1 << 24,
        offload: bool | str = False,
        reduce_dtype: torch.dtype = torch.float32,
        units: Sequence[nn.Module] = (),
        root: nn.Module | None = None,
        param_dtype: torch.dtype = torch.float32,
    ) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroOptimizer takes stages 0, 1, 2 and 3, got {stage}")
        offload = {True: "optimizer", False: "none"}.get(offload, offload)
        if offload not in ("none", "optimizer", "params"):
            raise ValueError(f"offload must be none, optimizer or params, got {offload!r}")
        if offload == "params" and stage != 3:
            raise ValueError("offload='params' keeps parameter shards on the CPU: stage 3 only")
        if stage == 3 and root is None:
            raise ValueError("stage 3 needs root= (the module whose forward runs the units)")
        self.distributed = dist.is_initialized()
        if not self.distributed and offload == "none":
            raise ValueError(
                "ZeRO needs a process group: launch with torchrun --nproc_per_node N "
                "-m memfit train ... (on one GPU, --offload optimizer works without one)"
            )
        self.stage = stage
        self.offload = offload != "none"
        self.offload_params = offload == "params"
        self.reduce_dtype = reduce_dtype
        self.param_dtype = param_dtype
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.sync = True
        self.buckets: list[_Bucket] = []
        self.units: list[_Unit] = []
        self._pending: deque[_Bucket] = deque()  # stages 2, 3: reduce-scatters in flight
        self._host = _HostBuffers()  # offload: where the CPU copies live
        # offload: gradients go to the host on their own stream as soon as they are final, and
        # what clipping or unscaling multiplies them by afterwards is applied in the CPU step
        self._copy_stream: torch.cuda.Stream | None = None
        self._grad_factor: Tensor | None = None
        groups = []
        for group in param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            for param in params:
                if param.dtype != torch.float32:
                    raise ValueError(
                        f"ZeRO shards fp32 parameters (memfit's master weights), got {param.dtype}"
                    )
            groups.append((params, {k: v for k, v in group.items() if k != "params"}))
        shard_groups: list[dict] = [{"params": [], **options} for _, options in groups]
        group_of = {id(p): i for i, (params, _) in enumerate(groups) for p in params}
        if stage == 3:
            self._device = next(p for params, _ in groups for p in params).device
            for index, members in enumerate(_unit_params(units, root, group_of)):
                buckets = []
                for group_index in sorted({group_of[id(p)] for p in members}):
                    chunk = [p for p in members if group_of[id(p)] == group_index]
                    bucket = _Bucket(chunk, group_index, self.world_size, self.rank)
                    self._bind_sharded(bucket)
                    buckets.append(bucket)
                    self.buckets.append(bucket)
                    shard_groups[group_index]["params"].append(bucket.shard)
                unit = _Unit(index, buckets, root=index == len(units))
                for bucket in buckets:
                    bucket.unit = unit
                self.units.append(unit)
            self._register_unit_hooks(list(units) + [root])
        else:
            for group_index, (params, _) in enumerate(groups):
                for chunk in _chunks(list(reversed(params)), bucket_numel):
                    bucket = _Bucket(chunk, group_index, self.world_size, self.rank)
                    self._bind_flat(bucket)
                    self.buckets.append(bucket)
                    shard_groups[group_index]["params"].append(bucket.shard)
        # parameter -> (its bucket, its index there), looked up by every gradient hook
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_grad)
        self._callback_queued = False
        if self.offload:
            # ZeRO-Offload: the optimizer steps fp32 copies of the shards in (pinned) CPU memory
            if self._grad_device(self.buckets[0]).type == "cuda":
                self._copy_stream = torch.cuda.Stream(self._grad_device(self.buckets[0]))
            for bucket in self.buckets:
                if bucket.cpu_shard is None:
                    bucket.cpu_shard = self._host.copy(bucket.shard)
                # stage 0 keeps the whole bucket on every rank, the others this rank's shard
                bucket.cpu_shard.grad = self._host.empty(bucket.cpu_shard.numel()).zero_()
            by_id = {id(b.shard): b.cpu_shard for b in self.buckets}
            shard_groups = [
                {**g, "params": [by_id[id(t)] for t in g["params"]]} for g in shard_groups
            ]
        self.optimizer = optimizer_factory(shard_groups)

    # -- layout --------------------------------------------------------------------------------

    def _bind_flat(self, bucket: _Bucket) -> None:
        """Stages 0-2: the parameters become views of one fp32 buffer; the shard is a view too."""
        bucket.flat_param = bucket.layout.empty(torch.float32, bucket.params[0].device)
        bucket.layout.pack([p.detach() for p in bucket.params], bucket.flat_param)
        for param, view in zip(bucket.params, bucket.layout.views(bucket.flat_param), strict=True):
            param.data = view.view(param.shape)
        whole = self.stage == 0
        bucket.shard = bucket.flat_param if whole else bucket.flat_param[bucket.start : bucket.end]

    def _bind_sharded(self, bucket: _Bucket) -> None:
        """Stage 3: keep this rank's fp32 shard; the parameters become views of a param_dtype
        buffer released at once (its storage has no memory until the unit is gathered)."""
        device = bucket.params[0].device
        shard = torch.zeros(bucket.layout.shard_numel, device=device)  # padding stays zero
        for piece in bucket.layout.pieces(self.rank):  # this rank's slices of the parameters
            values = bucket.params[piece.index].detach().reshape(-1)
            shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                values[piece.param_start : piece.param_start + piece.numel]
            )
        if self.offload_params:
            bucket.shard = bucket.cpu_shard = self._host.copy(shard)
        else:
            bucket.shard = shard
        bucket.full = torch.empty(bucket.layout.padded_numel, dtype=self.param_dtype, device=device)
        bucket.full_views = [
            view.view(param.shape)
            for param, view in zip(bucket.params, bucket.layout.views(bucket.full), strict=True)
        ]  # made while the storage has memory (a view of a released one cannot be made)
        for param, view in zip(bucket.params, bucket.full_views, strict=True):
            param.data = view
        _free(bucket.full)

    # Gradients exist from the first backward after zero_grad to the next zero_grad (which frees
    # them, as torch's zero_grad(set_to_none=True) does): not in a step's first forward, where
    # activations peak. Stages 0, 1 make the full flat gradient when the bucket's first gradient
    # arrives; stages 2, 3 make the gradient shard when the first reduce-scatter ends.

    def _full_grads(self, bucket: _Bucket) -> None:
        """Stages 0, 1: the bucket's flat fp32 gradient, the parameters' .grad views of it."""
        bucket.grad = bucket.layout.empty(torch.float32, bucket.shard.device)
        bucket.grad_views = [
            view.view(param.shape)
            for param, view in zip(bucket.params, bucket.layout.views(bucket.grad), strict=True)
        ]
        if self.stage == 0 and not self.offload:
            bucket.shard.grad = bucket.grad

    def _shard_grad(self, bucket: _Bucket, value: Tensor | None = None) -> Tensor:
        """Stages 1-3: this rank's fp32 gradient shard (zeros, or `value`), made if missing."""
        if bucket.shard_grad is None:
            if value is not None:
                bucket.shard_grad = value.float()
            else:
                device = self._grad_device(bucket)
                bucket.shard_grad = torch.zeros(bucket.layout.shard_numel, device=device)
            if not self.offload:
                bucket.shard.grad = bucket.shard_grad
        elif value is not None:
            bucket.shard_grad.add_(value)
        return bucket.shard_grad

    # -- stage 3: gathering and releasing parameters -------------------------------------------

    def _register_unit_hooks(self, modules: list[nn.Module]) -> None:
        for unit, module in zip(self.units, modules, strict=True):
            module.register_forward_pre_hook(lambda m, args, unit=unit: self._pre_forward(unit))
            module.register_forward_hook(
                lambda m, args, out, unit=unit: self._post_forward(unit, out)
            )

    def _gather(self, unit: _Unit) -> None:
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
            send = bucket.shard.to(self._device, non_blocking=True).to(self.param_dtype)
            if self.distributed:
                unit.sends.append(send)
                unit.works.append(_all_gather(full, send, group=self.group, async_op=True))
            else:
                full.copy_(send)

    def _wait_gathered(self, unit: _Unit) -> None:
        self._gather(unit)
        for work in unit.works:
            work.wait()
        unit.works.clear()
        unit.sends.clear()

    def _release(self, unit: _Unit) -> None:
        if not unit.gathered:
            return
        self._wait_gathered(unit)  # an all-gather still writing must finish first
        for bucket in unit.buckets:
            _free(bucket.full)
        unit.gathered = False

    def _pre_forward(self, unit: _Unit) -> None:
        if unit.root:
            self._gather(unit)
            self._wait_gathered(unit)
            if len(self.units) > 1:
                self._gather(self.units[0])
            return
        self._wait_gathered(unit)
        if unit.index + 1 < len(self.units) - 1:  # the next unit (the root is already there)
            self._gather(self.units[unit.index + 1])

    def _post_forward(self, unit: _Unit, output) -> None:
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

    def _pre_backward(self, unit: _Unit) -> None:
        """The gradient of the unit's output is in: its backward (and recompute) is next."""
        if unit.in_backward:
            return
        unit.in_backward = True
        self._queue_finish()
        self._wait_gathered(unit)
        if unit.index > 0:
            self._gather(self.units[unit.index - 1])

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Stage 3: inside, every parameter holds its full fp32 value (read-only: changes are
        not written back). Memory: the whole model in fp32 on every rank. Other stages: no-op."""
        if self.stage != 3:
            yield
            return
        for unit in self.units:
            self._release(unit)
        for bucket in self.buckets:
            flat = torch.empty(bucket.layout.padded_numel, device=self._device)
            shard = bucket.shard.to(self._device)
            if self.distributed:
                _all_gather(flat, shard, group=self.group)
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

    # -- communication -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the last one of an accumulation: stages 0 and 1 communicate nothing
        (stages 2 and 3 still reduce-scatter, see the module docstring)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _queue_finish(self) -> None:
        if not self._callback_queued and torch._C._current_graph_task_id() != -1:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, param: Tensor) -> None:
        self._queue_finish()
        bucket, index = self._slot[id(param)]
        if self.stage < 2:
            if bucket.grad is None:
                self._full_grads(bucket)
            view = bucket.grad_views[index]
            if param.grad is not view:  # autograd made it (the first backward since zero_grad)
                view.copy_(param.grad)
                param.grad = view  # later micro-steps accumulate into it in place
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params):
            self._launch(bucket)
            if self.stage == 3 and all(b.launched for b in bucket.unit.buckets):
                self._release(bucket.unit)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched or (self.stage < 2 and not self.sync):
            return
        bucket.launched, bucket.offloaded = True, False
        if self.stage >= 2:
            self._stage_gradients(bucket)
        elif bucket.grad is None:  # no gradient reached it here; the collective still runs
            self._full_grads(bucket)
        if not self.distributed:  # one process (single-GPU offload): the average is the gradient
            if self.stage == 1:
                self._shard_grad(bucket).copy_(bucket.grad)
            elif self.stage >= 2:
                bucket.reduced = bucket.grad
            self._finish_reduce(bucket)
            return
        if self.stage >= 2:  # bound the memory of reduce-scatters in flight
            while len(self._pending) >= _IN_FLIGHT:
                self._finish_reduce(self._pending.popleft())
        # input: the fp32 bucket (stages 0, 1), or its reduce_dtype copy; output: where the
        # optimizer reads (stage 0 in place, stage 1 into the fp32 shard), else a staging tensor
        # that _finish_reduce copies (stages 0, 1) or adds (stages 2, 3, which accumulate) from
        low = self.reduce_dtype != torch.float32
        source = bucket.grad
        if self.stage < 2 and low:
            source = bucket.grad.to(self.reduce_dtype)
        if self.stage == 0:
            bucket.reduced = source if low else None
            bucket.work = dist.all_reduce(
                source, op=dist.ReduceOp.AVG, group=self.group, async_op=True
            )
            return
        if self.stage == 1 and not low:
            target = self._shard_grad(bucket)
        else:
            target = bucket.reduced = torch.empty(
                bucket.layout.shard_numel, dtype=self.reduce_dtype, device=source.device
            )
        bucket.work = _reduce_scatter(
            target, source, op=dist.ReduceOp.AVG, group=self.group, async_op=True
        )
        if self.stage >= 2:
            bucket.grad = source  # keep the input alive until the collective is done
            self._pending.append(bucket)

    def _stage_gradients(self, bucket: _Bucket) -> None:
        """Stages 2, 3: copy the parameters' gradients into one reduce_dtype buffer (zeros where
        a parameter got none) and free them: the full-size gradient of a bucket exists only
        while its parameters' gradients come in and while its reduce-scatter is in flight."""
        bucket.grad = bucket.layout.empty(self.reduce_dtype, self._grad_device(bucket))
        for param, view in zip(bucket.params, bucket.layout.views(bucket.grad), strict=True):
            if param.grad is not None:
                view.copy_(param.grad.reshape(-1))
                param.grad = None

    def _grad_device(self, bucket: _Bucket) -> torch.device:
        return self._device if self.stage == 3 else bucket.shard.device

    def _finish_reduce(self, bucket: _Bucket) -> None:
        """Wait for the bucket's collective; move its result to where the optimizer reads."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        if bucket.reduced is not None:  # the collective wrote a staging tensor
            if self.stage == 0:
                bucket.grad.copy_(bucket.reduced)
            elif self.stage == 1:
                self._shard_grad(bucket).copy_(bucket.reduced)
            else:  # accumulates over micro-steps
                self._shard_grad(bucket, bucket.reduced)
            bucket.reduced = None
        if self.stage >= 2:
            bucket.grad = None
        if self.offload and self.sync and bucket.launched and not bucket.offloaded:
            self._offload_gradient(bucket)

    def _offload_gradient(self, bucket: _Bucket) -> None:
        """Start copying the bucket's final gradient of the step to the host (on CUDA: on the
        copy stream, overlapped with the rest of backward)."""
        grad, host = self._gradient(bucket), bucket.cpu_shard.grad
        if self._copy_stream is None:
            host.copy_(grad)
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._copy_stream):
                host.copy_(grad, non_blocking=True)
            grad.record_stream(self._copy_stream)  # not reused while the copy reads it
        bucket.offloaded = True

    def note_gradients_scaled(self, factor: Tensor | float) -> None:
        """The caller multiplied `gradients()` by `factor` in place (e.g. loss-scale unscaling):
        with offload, the host copies made before get it too, in the step."""
        if self.offload:
            factor = torch.as_tensor(factor, dtype=torch.float32)
            self._grad_factor = factor if self._grad_factor is None else self._grad_factor * factor

    def _finish_backward(self) -> None:
        """End of backward: start what has not started (buckets with parameters unused here, on
        this rank: every rank must run the same collectives), wait."""
        self._callback_queued = False
        for bucket in self.buckets:
            self._launch(bucket)
        while self._pending:
            self._finish_reduce(self._pending.popleft())
        for bucket in self.buckets:
            self._finish_reduce(bucket)
            bucket.arrived, bucket.launched = 0, False
        for unit in self.units:
            self._release(unit)
            unit.in_backward = False

    # -- optimizer -----------------------------------------------------------------------------

    def gradients(self) -> list[Tensor]:
        """The averaged gradients the optimizer will read, one flat tensor per bucket (this
        rank's shard in stages 1-3; stages 2, 3: of the buckets that received gradients): for
        loss-scale unscaling and overflow checks."""
        grads = [self._gradient(b) for b in self.buckets]
        return [g for g in grads if g is not None]

    def _gradient(self, bucket: _Bucket) -> Tensor | None:
        return bucket.grad if self.stage == 0 else bucket.shard_grad

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the (averaged) gradients so that their global L2 norm is at most max_norm (no
        clipping when max_norm is 0 or inf); returns the norm before clipping, the same on every
        rank."""
        grads = self.gradients()
        total = torch.zeros((), device=self._grad_device(self.buckets[0]))
        if grads:
            total = torch.stack([g.float().square().sum() for g in grads]).sum()
        if self.stage >= 1 and self.distributed:  # each rank holds a disjoint shard
            dist.all_reduce(total, group=self.group)
        norm = total.sqrt()
        if 0 < max_norm < math.inf:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale)
            self.note_gradients_scaled(scale)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        for bucket in self.buckets:  # no backward since zero_grad: step a zero gradient
            if self.stage == 0 and bucket.grad is None:
                self._full_grads(bucket)
            elif self.stage >= 1:
                self._shard_grad(bucket)
        if self.offload:
            self._host_gradients()
        self.optimizer.step()
        if hasattr(self.optimizer, "grad_scale"):
            del self.optimizer.grad_scale
        if self.offload and not self.offload_params:
            for bucket in self.buckets:
                bucket.shard.copy_(bucket.cpu_shard, non_blocking=True)
        if self.stage in (1, 2) and self.distributed:
            for bucket in self.buckets:
                shard = bucket.flat_param[bucket.start : bucket.end].clone()
                _all_gather(bucket.flat_param, shard, group=self.group)

    def _host_gradients(self) -> None:
        """Offload, before the CPU step: the gradients not yet copied are copied, every copy is
        waited for, and the factor the device gradients were multiplied by since is applied:
        by the fused optimizer's own unscaling (its grad_scale divides each gradient as it is
        read: no extra pass over the host memory), else by a multiply."""
        for bucket in self.buckets:
            if not bucket.offloaded:
                self._offload_gradient(bucket)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self._grad_factor is not None:
            factor = self._grad_factor.to("cpu", torch.float32)
            self._grad_factor = None
            if getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self.optimizer.grad_scale = 1.0 / factor
            else:
                torch._foreach_mul_([b.cpu_shard.grad for b in self.buckets], factor)

    def zero_grad(self) -> None:
        self._grad_factor = None  # a skipped step's factor must not reach the next one
        for bucket in self.buckets:
            bucket.offloaded = False
            if self.stage < 2:
                bucket.grad, bucket.grad_views = None, []
                for param in bucket.params:
                    param.grad = None
            bucket.shard_grad = None
            if not self.offload:
                bucket.shard.grad = None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (stage 3: the
        fp32 shards, not the units gathered for compute)."""
        if self.stage == 3:
            params = 0 if self.offload_params else sum(b.shard.numel() * 4 for b in self.buckets)
        else:
            params = sum(b.flat_param.numel() * 4 for b in self.buckets)
        # the gradients, which exist from backward to zero_grad
        grads = sum(b.layout.shard_numel * 4 for b in self.buckets)
        if self.stage == 0:
            grads = sum(b.layout.padded_numel * 4 for b in self.buckets)
        if self.stage == 1:
            grads += sum(b.layout.padded_numel * 4 for b in self.buckets)
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


class _HostBuffers:
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


def _free(tensor: Tensor) -> None:
    tensor.untyped_storage().resize_(0)


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
    grads = {0: 4 * num_params, 1: 4 * num_params + 4 * shard, 2: 4 * shard, 3: 4 * shard}[stage]
    return {
        "params": 4 * (shard if stage == 3 else num_params),
        "grads": grads,
        "optimizer_states": per_param * (num_params if stage == 0 else shard),
    }
