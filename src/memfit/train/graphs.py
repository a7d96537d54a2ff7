"""The training step captured in a CUDA graph (`train.cuda_graphs`, `memfit train --cuda-graphs`).

A small model's eager step is bound by the host: each block's forward and backward costs the
host about 2.6 ms of Python, dispatch and kernel launches (memfit.planner.time), more than the
GPU's work at a 135M model's widths. Captured once, the whole step (every micro-batch's forward
and backward, the clipping and the optimizer's update) replays with one launch, and the GPU sets
the pace. PyTorch's whole-network capture (torch.cuda.graph), as in its CUDA graphs notes:

    step 1:  eager, on a side stream (the warm-up the capture needs: cuBLAS handles, the
             optimizer's states, autocast's kernels), a real step
    step 2:  the step captured (it starts, as every step ends, with no gradients: its backward
             allocates them from the graph's memory pool, once), and replayed
    step 3+: the batch copied into the graph's input buffers, replayed

What a replay cannot change is fixed at capture: the shapes (every step's micro-batches are
(micro_batch, seq_len)), the learning rate's place (a device tensor the scheduler fills between
steps), and the step's token count, which the loss is divided by (a device scalar, filled before
each replay). The step reads nothing back on the host, so an fp16 run's loss scaling (whose skip
decision the host takes) and the sharded and offloaded optimizers, which talk to other ranks or
the CPU, keep eager steps (memfit.planner.search.capture_refusal says why).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from memfit.ops.cross_entropy import out_of_range_target
from memfit.train.precision import DynamicLossScaler
from memfit.train.step import StepResult, count_tokens, train_step

_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the warm-up step runs on, one a device for the process: torch keeps
    cuBLAS workspaces for every stream a product ever ran on (64 MiB a stream on an H200, as
    time_model.py's runs found), so a new stream a run would hold that much more for each run
    a process makes."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The optimizer's learning rates as device tensors (the scheduler fills them in place) and
    its step counts kept on the device: what an update inside a graph needs. Call after the
    scheduler is built (its base rates stay floats) and after a checkpoint's groups are loaded."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


class GraphedStep:
    """One optimizer step over `grad_accum` micro-batches of (micro_batch, seq_len) tokens:
    memfit.train.step's `train_step` for bf16 and fp32 runs on one process, captured once and
    replayed from a CUDA graph (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, updater, *, shape: tuple[int, int, int], vocab_size: int,
        precision: str, device: torch.device, grad_clip: float,
    ) -> None:  # fmt: skip
        """shape: (grad_accum, micro_batch, seq_len); updater: a `LocalOptimizer` whose
        optimizer `make_capturable` prepared; vocab_size: the targets' bound."""
        self.model, self.updater, self.vocab_size = model, updater, vocab_size
        self.precision, self.device, self.grad_clip = precision, device, grad_clip
        self.inputs = torch.zeros(shape, dtype=torch.long, device=device)
        self.targets = torch.full(shape, -100, dtype=torch.long, device=device)
        self.num_tokens = torch.ones((), dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps = 0
        self._outputs: StepResult | None = None

    def _step(self) -> StepResult:
        """`train_step` on the input buffers, dividing by the device's token count."""
        return train_step(
            self.model, self.updater, DynamicLossScaler(enabled=False),
            list(zip(self.inputs, self.targets, strict=True)), precision=self.precision,
            device=self.device, grad_clip=self.grad_clip, token_count=self.num_tokens,
        )  # fmt: skip

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._outputs = self._step()
        except RuntimeError as error:  # (torch.AcceleratorError is one too)
            first = error  # (the capture's end reports "a previous error": that one's cause)
            while first.__context__ is not None:
                first = first.__context__
            said = (str(first).strip() or type(first).__name__).splitlines()[0]
            raise RuntimeError(
                "--cuda-graphs: the step could not be captured, an operation in it cannot run "
                f"inside a CUDA graph ({said}); run without --cuda-graphs, in a new process (a failed "
                "capture leaves this one's CUDA state unusable)"
            ) from error
        self.graph = graph

    def __call__(self, micro_batches: Sequence[tuple[Tensor, Tensor]]) -> StepResult:
        if len(micro_batches) != self.inputs.shape[0]:
            raise ValueError(
                f"the graph was captured for {self.inputs.shape[0]} micro-batches a step, got "
                f"{len(micro_batches)}"
            )
        for index, (inputs, targets) in enumerate(micro_batches):
            # (the loss's own check of its targets reads the device: not inside the graph)
            bad = out_of_range_target(targets, self.vocab_size, -100)
            if bad is not None:
                raise ValueError(
                    f"targets must be in [0, {self.vocab_size}) or -100, got target {bad}"
                )
            if inputs.shape != self.inputs.shape[1:] or targets.shape != self.targets.shape[1:]:
                raise ValueError(
                    f"the graph was captured for micro-batches of {tuple(self.inputs.shape[1:])} "
                    f"tokens, got {tuple(inputs.shape)}: a captured step's shapes are fixed"
                )
            self.inputs[index].copy_(inputs, non_blocking=True)
            self.targets[index].copy_(targets, non_blocking=True)
        num_tokens = count_tokens(micro_batches)
        self.num_tokens.fill_(num_tokens)
        self.steps += 1
        if self.steps == 1:  # the warm-up: an eager step on a side stream
            stream = warmup_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                result = self._step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            result = self._outputs
        return StepResult(
            loss=result.loss, num_tokens=num_tokens, finite=True, grad_norm=result.grad_norm
        )
