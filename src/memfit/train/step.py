"""One training step, the only one: `memfit train` runs it, `memfit profile` observes it, and
with `--cuda-graphs` memfit.train.graphs captures it (bf16 and fp32 runs on one process) and
replays it.

    for each of the step's micro-batches (k of them, T target tokens in all):
        forward under autocast, loss = (sum of token losses) / T   -> the exact gradient of one
        backward of the (fp16: scaled) loss                           batch of k micro-batches
        (data parallel: gradients are reduced on the last micro-batch's backward only)
    unscale fp16 gradients and check them for inf/NaN (agreed across ranks); if finite: clip the
    global norm and step; zero the gradients; update the loss scale.

The optimizer is driven through one interface (`memfit.optim.LocalOptimizer` on one process,
`memfit.distributed.ZeroOptimizer` for every ZeRO stage and offload), so there is one path for all
strategies. A `StepObserver` is told the phase boundaries (forward, backward, optimizer) and the
moments worth measuring; the profiler's observer reads memory there. An observer must not
allocate on the device or keep a tensor alive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from memfit.train.precision import DynamicLossScaler, autocast


class Updater(Protocol):
    """What the step needs of the optimizer side (LocalOptimizer, ZeroOptimizer)."""

    def no_sync(self): ...
    def gradients(self) -> list[Tensor]: ...
    def note_gradients_scaled(self, factor: Tensor | float) -> None: ...
    def clip_grad_norm_(self, max_norm: float) -> Tensor: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...


class StepObserver:
    """Told the phase boundaries of `train_step`; this base observes nothing."""

    def begin(self, phase: str) -> None:
        """`phase` (forward, backward, optimizer) starts: once per micro-batch for the first
        two, once per step for the optimizer."""

    def end(self, phase: str) -> None:
        """`phase` ended."""

    def forward_done(self, micro_batch: int, loss: Tensor) -> None:
        """The forward of micro-batch `micro_batch` computed `loss`, still inside autocast, with
        everything it keeps for backward alive."""

    def backward_done(self) -> None:
        """The last backward of the step is done: the gradients are all there, not yet unscaled,
        clipped, stepped or freed."""

    def optimizer_stepped(self) -> None:
        """The optimizer stepped (or would have: fp16 overflow skips the step itself)."""


@dataclass
class StepResult:
    loss: Tensor
    """This rank's loss of the step (a device scalar: reading it syncs)."""
    num_tokens: int
    """This rank's target tokens."""
    finite: bool
    """False when fp16 gradients overflowed and the step was skipped."""
    grad_norm: Tensor
    """The global gradient norm before clipping (0 when skipped)."""


def train_step(
    model: torch.nn.Module,
    updater: Updater,
    scaler: DynamicLossScaler,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    *,
    precision: str,
    device: torch.device,
    grad_clip: float,
    across_ranks: bool = False,
    observer: StepObserver | None = None,
    token_count: Tensor | None = None,
) -> StepResult:
    """One optimizer step over `micro_batches` ((inputs, targets) pairs of token ids, each
    (micro_batch, seq_len); targets -100 where no loss is taken). See the module docstring.

    token_count: the step's target tokens as a device scalar, for a step being captured in a CUDA
    graph (memfit.train.graphs), which reads nothing on the host: the loss is divided by it,
    autocast keeps no cache of cast weights, and the result's num_tokens is 0 (the capturer
    counts each replay's on the host)."""
    observer = observer or StepObserver()
    captured = token_count is not None
    num_tokens = 0 if captured else count_tokens(micro_batches)
    divisor = token_count if captured else num_tokens
    loss_sum = torch.zeros((), device=device)
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        last = index == len(micro_batches) - 1
        # data parallel: communicate once per step, on the last micro-batch's backward
        with updater.no_sync() if not last else contextlib.nullcontext():
            observer.begin("forward")
            with autocast(precision, device, cache=not captured):
                # per rank, the mean over its tokens; the ranks' gradients are then averaged
                loss = model(inputs, targets) / divisor
                observer.forward_done(index, loss)
            observer.end("forward")
            observer.begin("backward")
            scaler.scale(loss).backward()
            observer.end("backward")
        loss_sum += loss.detach()
        del loss

    observer.begin("optimizer")
    observer.backward_done()
    finite = scaler.unscale_and_check_grads(updater.gradients(), across_ranks=across_ranks)
    if scaler.enabled:  # offload: for the host's copies made before the unscaling
        updater.note_gradients_scaled(1.0 / scaler.scale_value)
    grad_norm = torch.zeros((), device=device)
    if finite:
        grad_norm = updater.clip_grad_norm_(grad_clip)
        updater.step()
    observer.optimizer_stepped()
    updater.zero_grad()
    scaler.update()
    observer.end("optimizer")
    return StepResult(loss=loss_sum, num_tokens=num_tokens, finite=finite, grad_norm=grad_norm)


def count_tokens(micro_batches: Sequence[tuple[Tensor, Tensor]]) -> int:
    """The target tokens of a step's micro-batches (those not -100); reads them on the host."""
    return sum(int((targets != -100).sum()) for _, targets in micro_batches)
