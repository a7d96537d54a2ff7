"""ZeRO stages 0-3, the optimizer side: gradients reduced over flat buckets, the optimizer
stepped on this rank's shards, and ZeRO-Offload (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 5; Ren et al. 2021).

Stage 3's parameter sharding is a transform of the model (`distributed.sharding`), applied before
this optimizer is built; `ZeroOptimizer(stage=3, sharded=...)` works on the buckets it made.
The bytes each stage keeps per rank are `memfit.optim.model_state_bytes` (the planner's formula;
the tests compare `state_bytes()`, measured from the real tensors, with it).

Layout. Parameters are grouped into buckets (`distributed.buckets`), never mixing optimizer
parameter groups. Each bucket is a `FlatLayout` split into N equal shards. The wrapped torch
optimizer sees one tensor per bucket: this rank's fp32 shard (stage 0: the whole bucket), so its
step updates that shard.
- Stages 0-2: buckets of about `bucket_numel` elements, in reverse order (the order backward
  produces their gradients). The parameters' storage becomes views of the bucket's flat fp32
  buffer and the optimizer's shard is a view of it too: gathering the updated shards into that
  buffer (stages 1, 2) updates the parameters in place.
- Stage 3: the sharding transform's buckets (one per unit and group), whose fp32 shards are the
  only copy of the parameters.
Frozen parameters (requires_grad=False) are in no bucket: no gradient, no optimizer state,
replicated on every rank. Trainable parameters are fp32 (memfit's master weights).

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
gradients (half the bytes) and their results are added back into the fp32 buffers. All of it runs
over `process_group` (a DeviceMesh's data-parallel dimension, so that data parallelism can sit
beside tensor or pipeline parallelism; None: the default group).

Gradient accumulation: stages 0 and 1 keep full gradients and accumulate locally; inside
`no_sync()` nothing is communicated and the last micro-step communicates once. Stages 2 and 3
cannot keep full gradients without giving up their saving, so they reduce-scatter every
micro-step and add into the fp32 shard (communication x grad_accum, memory 4P/N); stage 3 also
gathers the parameters every micro-step.

Offload (ZeRO-Offload, Ren et al. 2021): with `offload="optimizer"` the optimizer states and an
fp32 master copy of each shard live in (pinned) CPU memory and the optimizer steps there (torch's
vectorized AdamW over the flat shard); the averaged gradient shard is copied to the host before
the step and the updated shard back after it. `offload="params"` (stage 3: the sharding
transform's `offload_params`) also keeps the parameter shards there only. Both run without a
process group, on one GPU. Each bucket's gradient is copied to the host, on its own CUDA stream,
as soon as it is final (after the last micro-step's reduction), so the copies overlap the rest of
backward; what the loss scaler's unscaling and clipping multiply the device gradients by
afterwards (`note_gradients_scaled`) is applied in the CPU step, by the fused AdamW's own
grad_scale (no extra pass over the host memory) or by a multiply.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from memfit.distributed.buckets import (
    Bucket,
    HostBuffers,
    all_gather,
    grad_hook_of,
    group_info,
    reduce_scatter,
)
from memfit.distributed.sharding import ShardedParameters

__all__ = ["ZeroOptimizer"]

_IN_FLIGHT = 1  # stages 2, 3: reduce-scatters outstanding at once (their buffers held)


class ZeroOptimizer:
    """Shards the states of `optimizer_factory(groups)` across the ranks of `process_group`.

    param_groups: like a torch optimizer's (dicts with "params" and per-group options);
    optimizer_factory: builds the torch optimizer from groups whose "params" are the flat shards
    (e.g. `lambda groups: torch.optim.AdamW(groups, lr=1e-3)`); `.optimizer` is it, for LR
    schedulers. Call `backward` as usual, then `clip_grad_norm_` (optional), `step`, `zero_grad`.
    Stage 3 takes `sharded`, the model's `distributed.sharding.shard_parameters(...)` made over
    the same parameter groups and process group; `offload="params"` needs it made with
    `offload_params=True`.
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
        sharded: ShardedParameters | None = None,
    ) -> None:
        offload = {True: "optimizer", False: "none"}.get(offload, offload)
        if stage not in (0, 1, 2, 3) or offload not in ("none", "optimizer", "params"):
            raise ValueError(
                f"ZeroOptimizer takes stages 0-3 and offload none, optimizer or params; got "
                f"stage={stage}, offload={offload!r}"
            )
        if (stage == 3) != (sharded is not None):
            raise ValueError("stage 3, and only stage 3, takes sharded= (shard_parameters(...))")
        if sharded is not None and sharded.offload_params != (offload == "params"):
            raise ValueError("offload='params' and the sharding's offload_params must agree")
        self.distributed, self.world_size, self.rank = group_info(process_group)
        if not self.distributed and offload == "none":
            raise ValueError(
                "ZeRO needs a process group: launch with torchrun --nproc_per_node N "
                "-m memfit train ... (on one GPU, --offload optimizer works without one)"
            )
        self.stage = stage
        self.offload = offload != "none"
        self.offload_params = offload == "params"
        self.reduce_dtype = reduce_dtype
        self.group = process_group
        self.sharded = sharded
        self.sync = True
        self.buckets: list[Bucket] = []
        self._pending: deque[Bucket] = deque()  # stages 2, 3: reduce-scatters in flight
        self._host = sharded.host if sharded is not None else HostBuffers()  # offload's copies
        # offload: gradients go to the host on their own stream as soon as they are final, and
        # what clipping or unscaling multiplies them by afterwards is applied in the CPU step
        self._copy_stream: torch.cuda.Stream | None = None
        self._grad_factor: Tensor | None = None
        groups = []
        for group in param_groups:
            params = [p for p in group["params"] if p.requires_grad]  # frozen: left alone
            for param in params:
                if param.dtype != torch.float32 and (stage > 0 or self.offload):
                    raise ValueError(
                        f"ZeRO stages 1-3 and offload shard fp32 parameters (memfit's master "
                        f"weights), got {param.dtype}: train it with --zero 0"
                    )
            groups.append((params, {k: v for k, v in group.items() if k != "params"}))
        shard_groups: list[dict] = [{"params": [], **options} for _, options in groups]
        if sharded is not None:
            self.buckets = list(sharded.buckets)
        else:
            for group_index, (params, _) in enumerate(groups):
                for dtype in dict.fromkeys(p.dtype for p in params):  # one dtype per bucket
                    same = [p for p in reversed(params) if p.dtype == dtype]
                    for chunk in _chunks(same, bucket_numel):
                        bucket = Bucket(chunk, group_index, self.world_size, self.rank)
                        self._bind_flat(bucket)
                        self.buckets.append(bucket)
        for bucket in self.buckets:
            shard_groups[bucket.group_index]["params"].append(bucket.shard)
        # parameter -> (its bucket, its index there), looked up by every gradient hook
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(grad_hook_of(self._on_grad))
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

    def _bind_flat(self, bucket: Bucket) -> None:
        """Stages 0-2: the parameters become views of one flat buffer (fp32, the master weights;
        stage 0 also takes other dtypes); the shard is a view too."""
        first = bucket.params[0]
        bucket.flat_param = bucket.layout.empty(first.dtype, first.device)
        bucket.layout.pack([p.detach() for p in bucket.params], bucket.flat_param)
        for param, view in zip(bucket.params, bucket.layout.views(bucket.flat_param), strict=True):
            param.data = view.view(param.shape)
        whole = self.stage == 0
        bucket.shard = bucket.flat_param if whole else bucket.flat_param[bucket.start : bucket.end]

    # Gradients exist from the first backward after zero_grad to the next zero_grad (which frees
    # them, as torch's zero_grad(set_to_none=True) does): not in a step's first forward, where
    # activations peak. Stages 0, 1 make the full flat gradient when the bucket's first gradient
    # arrives; stages 2, 3 make the gradient shard when the first reduce-scatter ends.

    def _full_grads(self, bucket: Bucket) -> None:
        """Stages 0, 1: the bucket's flat gradient (in its parameters' dtype, fp32 but for stage
        0's other dtypes), the parameters' .grad views of it."""
        bucket.grad = bucket.layout.empty(bucket.shard.dtype, bucket.shard.device)
        bucket.grad_views = [
            view.view(param.shape)
            for param, view in zip(bucket.params, bucket.layout.views(bucket.grad), strict=True)
        ]
        if self.stage == 0 and not self.offload:
            bucket.shard.grad = bucket.grad

    def _shard_grad(self, bucket: Bucket, value: Tensor | None = None) -> Tensor:
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

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Stage 3: the sharding's `summon_full_params` (every parameter its full fp32 value, for
        a while); the other stages keep whole parameters: nothing to do."""
        with (
            self.sharded.summon_full_params()
            if self.sharded is not None
            else contextlib.nullcontext()
        ):
            yield

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

    def _launch(self, bucket: Bucket) -> None:
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
        bucket.work = reduce_scatter(
            target, source, op=dist.ReduceOp.AVG, group=self.group, async_op=True
        )
        if self.stage >= 2:
            bucket.grad = source  # keep the input alive until the collective is done
            self._pending.append(bucket)

    def _stage_gradients(self, bucket: Bucket) -> None:
        """Stages 2, 3: copy the parameters' gradients into one reduce_dtype buffer (zeros where
        a parameter got none) and free them: the full-size gradient of a bucket exists only
        while its parameters' gradients come in and while its reduce-scatter is in flight."""
        bucket.grad = bucket.layout.empty(self.reduce_dtype, self._grad_device(bucket))
        for param, view in zip(bucket.params, bucket.layout.views(bucket.grad), strict=True):
            if param.grad is not None:
                view.copy_(param.grad.reshape(-1))
                param.grad = None

    def _grad_device(self, bucket: Bucket) -> torch.device:
        return self.sharded.device if self.sharded is not None else bucket.shard.device

    def _finish_reduce(self, bucket: Bucket) -> None:
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

    def _offload_gradient(self, bucket: Bucket) -> None:
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

    # -- optimizer -----------------------------------------------------------------------------

    def gradients(self) -> list[Tensor]:
        """The averaged gradients the optimizer will read, one flat tensor per bucket (this
        rank's shard in stages 1-3; stages 2, 3: of the buckets that received gradients): for
        loss-scale unscaling and overflow checks."""
        grads = [self._gradient(b) for b in self.buckets]
        return [g for g in grads if g is not None]

    def _gradient(self, bucket: Bucket) -> Tensor | None:
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
                all_gather(bucket.flat_param, shard, group=self.group)

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

    def held_gradients(self) -> list[Tensor]:
        """Every gradient tensor this rank holds now (full buckets, shards, parameters' .grad
        not yet staged), for measuring memory."""
        found = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        found += [b.grad for b in self.buckets if b.grad is not None]
        return found + [b.shard_grad for b in self.buckets if b.shard_grad is not None]

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds on its device for parameters, gradients (from backward to
        zero_grad: their sizes, whether alive now or not) and optimizer states, and in host memory
        under offload: read off the real tensors, for comparison with the planner's
        `memfit.optim.model_state_bytes`. Stage 3: the fp32 shards, not the units gathered for
        compute."""
        if self.sharded is not None:
            params = self.sharded.parameter_bytes()
        else:
            params = sum(b.flat_param.numel() * b.flat_param.element_size() for b in self.buckets)
        full = sum(b.layout.padded_numel * b.shard.element_size() for b in self.buckets)
        shards = sum(b.layout.shard_numel * 4 for b in self.buckets)
        grads = {0: full, 1: full + shards, 2: shards, 3: shards}[self.stage]
        optimizer = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, Tensor) and t.dim() > 0
        )
        if self.offload:  # in host memory, with the master copies and their gradients
            host = optimizer + sum(2 * b.cpu_shard.numel() * 4 for b in self.buckets)
            return {"params": params, "grads": grads, "optimizer_states": 0, "host": host}
        return {"params": params, "grads": grads, "optimizer_states": optimizer, "host": 0}


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
