"""The single-process optimizer driver: a torch optimizer behind the interface the train step
drives, the one `distributed.zero.ZeroOptimizer` has (no_sync, gradients, clip_grad_norm_,
note_gradients_scaled, step, zero_grad), so that one `train_step` serves every strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


class LocalOptimizer:
    """`optimizer` over whole parameters on one process: nothing to reduce or shard."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def gradients(self) -> list[Tensor]:
        """The gradients the step will read (for unscaling and overflow checks)."""
        return [p.grad for p in self.params if p.grad is not None]

    held_gradients = gradients

    def note_gradients_scaled(self, factor: Tensor | float) -> None:
        """The gradients were multiplied in place: they are what the step reads, nothing to do."""

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip the global L2 norm to `max_norm` (0: no clipping); the norm before clipping."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        grads = self.gradients()
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def summon_full_params(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
