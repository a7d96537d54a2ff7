"""Measure where the memory of real training steps goes, in the planner's categories.

`measure_memory(trainer, steps=3)` runs `warmup_steps` steps (compilation, AdamW's lazily created
states), then `steps` measured steps, then one extra forward (the liveness probe). The steps are
`Trainer.train_step`, the engine's own (train/step.py), told to a `StepObserver` that reads
memory at the phase boundaries; they advance the trainer's data, weights and schedule as training
would, for every strategy the engine runs (ZeRO stages, offload, under torchrun: each rank
measures its own). Nothing the observer does allocates on the device or keeps a tensor alive.

How each category is measured (bytes, on this rank's device):
- params: the parameters' storages (tensor accounting; a tied embedding counted once; stages
  0-2: the flat buffers they are views of). ZeRO-3: this rank's fp32 shards (0 with
  --offload params); the blocks gathered for compute are temporaries.
- master_weights: 0. memfit's parameters are the fp32 master weights (autocast casts them per
  matmul), so there is no separate master copy; they are counted under params.
- grads: the gradient storages the optimizer side holds right after the backward of the last
  micro-batch of the last step, before the optimizer phase unscales, steps and frees them (the
  parameters' `.grad`; ZeRO: the flat gradient buckets and this rank's gradient shards).
- optimizer_states: the device tensors in `optimizer.state` right after the last step's `optimizer.step()`
  (or where it would have been, if fp16 overflow skipped it): AdamW's two moments, SGD's
  momentum. 0-dim bookkeeping tensors (AdamW's step counters, one scalar per parameter tensor)
  are left out. Under offload they are in host memory: `host_bytes`, with the fp32 master shards
  and their gradients.
- logits_loss: what the fused linear cross-entropy keeps for backward (it computes its gradients
  during the forward; ops/cross_entropy.py): the tensors saved on the `LinearCrossEntropyFunction`
  autograd node, found by walking `loss.grad_fn` at the end of the forward: grad_hidden (tokens x
  hidden; bf16 under bf16 autocast, else fp32) and grad_weight (vocab x hidden, fp32).
- temporaries: autocast's weight copies. Under autocast each matmul casts its fp32 weight to the
  compute dtype once per forward and caches the copy until the autocast context exits (without
  checkpointing the matmuls also keep it for backward). Measured in the probe forward: a
  TorchDispatchMode records every storage created by an op whose input is a parameter and whose
  output has that parameter's shape in another dtype; the bytes of those still alive at the end of
  the forward (inside the autocast context) are the temporaries. 0 in fp32. ZeRO-3: instead the
  parameters gathered at the end of the first micro-batch's forward (in the compute dtype, so
  autocast copies nothing): the root unit and the prefetched block.
- activations: what one micro-batch's forward leaves for backward, less logits_loss and
  temporaries (counted above; ZeRO-3: less the gathered parameters). Measured at the end of the forward, inside the autocast context.
  CUDA: `torch.cuda.memory_allocated()` right after the loss is computed minus right before the
  forward started, in the first micro-batch of the last measured step. CPU (no allocator
  statistics): in the probe forward, the bytes of the storages created by the forward and still
  alive at its end (the storage-liveness method of tests/train/activation_memory.py: a dispatch
  mode keeps a weak reference to every storage an op returns; the live ones are held by the
  autograd graph, or by autocast's cache, for backward), the parameters and the loss itself left out.
- runtime_overhead: a REMAINDER, CUDA only: peak allocated minus the sum of the six categories
  above, or 0 if that is negative. It holds what no category names: cuBLAS workspaces, the loss's
  chunk buffers and a layer's backward intermediates at the peak, the foreach optimizer's
  temporaries, allocator rounding (512-byte blocks). On CPU: 0 (there is no peak to subtract from).

Peaks (CUDA): `torch.cuda.reset_peak_memory_stats()` at the start of the first measured step;
in the last one the stats are read and reset around each phase (forward, backward: the largest
over the micro-batches; optimizer: unscale, clip, step and zero_grad), the overall peak being the
largest of all readings. On CPU the peaks are None and `phase_peaks` is empty.

Cautions:
- The probe forward runs with torch.compile switched off (`torch.compiler.set_stance
  ("force_eager")`), since a compiled graph's buffers are invisible to a dispatch mode. For a
  compiled model, temporaries are therefore those of the eager forward: the compiled graph may
  instead save the fp32 weight and recompute the cast in backward, in which case the CUDA
  activations (a difference of memory_allocated, exact for the compiled run) come out low by
  up to that amount. The probe also consumes one micro-batch of data.
- Measuring activations in the first micro-batch: with gradient accumulation every micro-batch
  has the same shapes, so any one of them keeps the same bytes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.planner.memory import CATEGORIES
from memfit.profile.timeline import CudaTimelineRecorder, MemoryTimeline
from memfit.train.engine import Trainer
from memfit.train.precision import autocast
from memfit.train.step import StepObserver

PHASES = ("forward", "backward", "optimizer")


@dataclass
class MemoryMeasurement:
    """Measured memory of a training step (see the module docstring for each category)."""

    breakdown: dict[str, int]
    """Bytes per category, keys `CATEGORIES`."""
    peak_allocated_bytes: int | None
    """torch.cuda.max_memory_allocated() over the measured steps; None on CPU."""
    peak_reserved_bytes: int | None
    """torch.cuda.max_memory_reserved() over the measured steps; None on CPU."""
    phase_peaks: dict[str, int]
    """Peak allocated bytes in each phase of the last step (forward, backward, optimizer); empty
    on CPU."""
    device: str
    steps: int
    """Measured steps (after the warm-up)."""
    timeline: MemoryTimeline | None = None
    """Allocated bytes over the last step (CUDA only)."""
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    """Offload: host memory of this rank's fp32 master shards, their gradients and the optimizer
    states (read off the tensors)."""
    phase_reserved: dict[str, int] = field(default_factory=dict)
    """Peak reserved bytes (torch.cuda.max_memory_reserved) in each phase of the last step. Empty
    on CPU."""

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def fragmentation(self) -> dict[str, float]:
        """Per phase, (peak reserved - peak allocated) over the step's peak allocated: what the
        caching allocator holds beyond what is allocated. At the phase of the step's peak that
        is its fragmentation (split blocks, blocks cached for other sizes), what the GPU must
        hold beyond the planned peak; in a later phase it is also the cache of what the earlier
        ones freed (reusable, and given back before an allocation fails)."""
        peak = self.peak_allocated_bytes
        if not peak:
            return {}
        return {
            phase: (self.phase_reserved[phase] - allocated) / peak
            for phase, allocated in self.phase_peaks.items()
            if phase in self.phase_reserved
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "steps": self.steps,
            "breakdown": dict(self.breakdown),
            "total_bytes": self.total_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "phase_peaks": dict(self.phase_peaks),
            "phase_reserved": dict(self.phase_reserved),
            "fragmentation": self.fragmentation,
            "host_bytes": self.host_bytes,
            "notes": list(self.notes),
        }


# -- tensor accounting -------------------------------------------------------------------------


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of `optimizer`'s per-element states on `device` (offloaded ones are on the host)."""
    states = (
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return _storage_bytes(_on(device, states))


def _find_loss_node(loss: torch.Tensor) -> Any | None:
    """The autograd node of memfit's fused linear cross-entropy in loss's graph, or None."""
    stack = [loss.grad_fn]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "LinearCrossEntropy" in type(node).__name__:
            return node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return None


def _loss_saved_bytes(loss: torch.Tensor) -> int | None:
    """Bytes the linear cross-entropy saved for backward (grad_hidden, grad_weight); None if the
    loss was not computed by it."""
    node = _find_loss_node(loss)
    if node is None:
        return None
    return _storage_bytes(node.saved_tensors)


# -- the liveness probe ------------------------------------------------------------------------


class _StorageRecorder(TorchDispatchMode):
    """Weak references to every storage an op returns, flagging casts of parameters. Storages
    `parameter_buffers()` names (ZeRO-3's gathered parameters, written in place by the all-gather,
    which returns them) are parameters, not new storages."""

    def __init__(
        self, parameter_storages: set[int], parameter_buffers: Callable[[], set[int]] = set
    ) -> None:
        super().__init__()
        self.parameter_storages = parameter_storages
        self.parameter_buffers = parameter_buffers
        self.storages: list[tuple[StorageWeakRef, int, int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        from_parameter = (
            isinstance(source, torch.Tensor)
            and source.untyped_storage().data_ptr() in self.parameter_storages
        )
        buffers = None
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                buffers = self.parameter_buffers() if buffers is None else buffers
                if storage.data_ptr() in buffers:
                    continue
                is_weight_copy = (
                    from_parameter and tensor.shape == source.shape and tensor.dtype != source.dtype
                )
                self.storages.append(
                    (StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(), is_weight_copy)
                )
        return out

    def live(self, exclude: set[int]) -> tuple[int, int]:
        """(bytes of all recorded storages alive now, of which weight copies), each storage once.
        An address can be reused after its storage is freed: only live storages count."""
        alive: dict[int, int] = {}
        copies: set[int] = set()
        for ref, ptr, nbytes, is_copy in self.storages:
            if ref.expired() or ptr in exclude:
                continue
            alive[ptr] = nbytes
            if is_copy:  # views of the copy (the matmul's transpose) record the storage again
                copies.add(ptr)
        return sum(alive.values()), sum(alive[ptr] for ptr in copies)


@dataclass
class _ProbeResult:
    live_bytes: int
    weight_copy_bytes: int
    loss_saved_bytes: int | None


def _eager(trainer: Trainer) -> contextlib.AbstractContextManager:
    set_stance = getattr(torch.compiler, "set_stance", None)  # PyTorch >= 2.6
    if trainer.compiled and set_stance is not None:
        return set_stance("force_eager")
    return contextlib.nullcontext()


def _probe_forward(trainer: Trainer) -> _ProbeResult:
    """One forward of a fresh micro-batch under the storage recorder; nothing kept after it."""
    inputs, targets = next(trainer.batches)
    inputs = inputs.to(trainer.device)
    targets = targets.to(trainer.device)
    num_tokens = max(1, int((targets != -100).sum()))
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    sharded = trainer.sharded

    def gathered() -> set[int]:
        if sharded is None:
            return set()
        return {b.full.untyped_storage().data_ptr() for b in sharded.buckets}

    recorder = _StorageRecorder(parameters, gathered)
    with _eager(trainer), autocast(trainer.precision, trainer.device):
        with recorder:
            loss = trainer.model(inputs, targets) / num_tokens
        gc.collect()  # whatever only a reference cycle still holds is not held for backward
        live, copies = recorder.live(exclude=parameters | {loss.untyped_storage().data_ptr()})
        saved = _loss_saved_bytes(loss)
    del loss, recorder  # frees the graph: the probe leaves nothing behind
    if trainer.sharded is not None:  # no backward follows to release the root
        trainer.sharded.release_all()
    return _ProbeResult(live_bytes=live, weight_copy_bytes=copies, loss_saved_bytes=saved)


# -- the observed step ---------------------------------------------------------------------


class _LastStepObserver(StepObserver):
    """Phase peaks, the first micro-batch's forward delta, loss buffers, grads and states."""

    def __init__(self, trainer: Trainer, timeline: CudaTimelineRecorder | None) -> None:
        self.trainer = trainer
        self.device = trainer.device
        self.cuda = self.device.type == "cuda"
        self.timeline = timeline
        self.phase_peaks: dict[str, int] = {}
        self.phase_reserved: dict[str, int] = {}
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.forward_start = 0
        self.forward_delta: int | None = None
        self.loss_saved: int | None = None
        self.gathered = 0
        self.grads = 0
        self.optimizer_states = 0

    def _read_peaks(self) -> tuple[int, int]:
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)
        return allocated, reserved

    def begin(self, phase: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(f"{phase}:begin")
        if self.cuda:
            self._read_peaks()  # what came before this phase, then count the phase alone
            torch.cuda.reset_peak_memory_stats(self.device)
            if phase == "forward":
                self.forward_start = torch.cuda.memory_allocated(self.device)

    def end(self, phase: str) -> None:
        if self.cuda:
            allocated, reserved = self._read_peaks()
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), allocated)
            self.phase_reserved[phase] = max(self.phase_reserved.get(phase, 0), reserved)
        if self.timeline is not None:
            self.timeline.mark(f"{phase}:end")

    def forward_done(self, micro_batch: int, loss: torch.Tensor) -> None:
        if micro_batch != 0:
            return
        if self.cuda:
            self.forward_delta = torch.cuda.memory_allocated(self.device) - self.forward_start
        self.loss_saved = _loss_saved_bytes(loss)
        sharded = self.trainer.sharded
        if sharded is not None:
            self.gathered = _storage_bytes(b.full for b in sharded.buckets)

    def backward_done(self) -> None:
        self.grads = _storage_bytes(_on(self.device, self.trainer.updater.held_gradients()))

    def optimizer_stepped(self) -> None:
        zero = self.trainer.zero
        if zero is not None and zero.offload:  # in host memory (also when the device is the CPU)
            self.optimizer_states = 0
        else:
            self.optimizer_states = _optimizer_state_bytes(self.trainer.optimizer, self.device)


def _on(device: torch.device, tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None and t.device.type == device.type]


# -- the measurement ---------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def measure_memory(
    trainer: Trainer, *, steps: int = 3, warmup_steps: int = 1, timeline: bool = True
) -> MemoryMeasurement:
    """Run `warmup_steps` + `steps` training steps of `trainer` and one probe forward, and measure
    the memory of a step by category (see the module docstring).

    timeline: on CUDA, also record the allocator's events over the last step
    (`MemoryMeasurement.timeline`); ignored on CPU.
    """
    if steps < 1 or warmup_steps < 0:
        raise ValueError(
            f"measure_memory needs steps >= 1 and warmup_steps >= 0, got steps={steps}, "
            f"warmup_steps={warmup_steps}"
        )
    device = trainer.device
    cuda = device.type == "cuda"
    notes: list[str] = []
    for _ in range(warmup_steps):
        trainer.train_step()

    if cuda:
        gc.collect()  # garbage of the warm-up must not count in the measured steps
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    recorder = CudaTimelineRecorder(device) if cuda and timeline else None
    observer = _LastStepObserver(trainer, recorder)
    recorded: MemoryTimeline | None = None
    for index in range(steps):
        last = index == steps - 1
        if last and recorder is not None:
            recorder.start()
        try:
            trainer.train_step(observer if last else None)
        finally:
            if last and recorder is not None:
                recorded = recorder.stop()
    if cuda:
        torch.cuda.synchronize(device)
        observer._read_peaks()
    if recorded is not None and recorded.truncated:
        notes.append("the allocator history overflowed: the timeline lost the step's first events")

    # The probe runs after every peak has been read: it cannot raise them. On CUDA in fp32 it
    # has nothing to find (no weight copies; activations come from the allocator).
    probe = _ProbeResult(live_bytes=0, weight_copy_bytes=0, loss_saved_bytes=None)
    if not cuda or trainer.precision != "fp32":
        try:
            probe = _probe_forward(trainer)
        except torch.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            notes.append("the eager probe forward ran out of memory: temporaries not measured (0)")

    if trainer.sharded is not None:
        params = trainer.sharded.parameter_bytes()
    else:
        params = _storage_bytes(_on(device, trainer.model.parameters()))
    logits_loss = observer.loss_saved
    if logits_loss is None:
        logits_loss = 0
        notes.append("the loss is not memfit's linear cross-entropy: logits_loss not measured")
    temporaries = max(probe.weight_copy_bytes, observer.gathered)
    if cuda:
        forward_bytes = observer.forward_delta or 0
        loss_in_forward = logits_loss
    else:
        forward_bytes = probe.live_bytes
        loss_in_forward = probe.loss_saved_bytes or 0
    # CUDA's forward delta holds the units gathered in it (their storages grow in place, which
    # the CPU probe's recorder does not see as new storages)
    in_forward = probe.weight_copy_bytes + (observer.gathered if cuda else 0)
    activations = max(0, forward_bytes - loss_in_forward - in_forward)

    measured = {
        "params": params,
        "grads": observer.grads,
        "master_weights": 0,
        "optimizer_states": observer.optimizer_states,
        "activations": activations,
        "logits_loss": logits_loss,
        "temporaries": temporaries,
        "runtime_overhead": 0,
    }
    breakdown = {category: measured[category] for category in CATEGORIES}  # the planner's order
    peak_allocated = peak_reserved = None
    if cuda:
        peak_allocated, peak_reserved = observer.peak_allocated, observer.peak_reserved
        breakdown["runtime_overhead"] = max(0, peak_allocated - sum(breakdown.values()))
    else:
        notes.append(
            "cpu: no allocator statistics, so no peaks, phase peaks, runtime overhead or timeline; "
            "activations and temporaries come from storage liveness"
        )
    return MemoryMeasurement(
        breakdown=breakdown,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        phase_peaks=dict(observer.phase_peaks),
        phase_reserved=dict(observer.phase_reserved),
        device=_device_name(device),
        steps=steps,
        timeline=recorded,
        notes=notes,
        host_bytes=trainer.zero.state_bytes()["host"] if trainer.zero is not None else 0,
    )
