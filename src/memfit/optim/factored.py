"""What Adafactor and SM3 share: per-row and per-column statistics of each matrix, updated by
the Triton kernels of `memfit.ops.optim_factored`, one launch a pass for all the matrices of one
shape and dtype (a table of their addresses) instead of a Python loop of launches per matrix.

A subclass names its options' check (`check_options`) and supplies three methods: `init_state`
(a new parameter's states), `together_key` (which matrices may share a launch, None for one
that steps alone) and `update_together` / `update_alone` (the steps). The step counter of every
parameter is a CPU tensor, so reading it never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from memfit.ops._triton import use_triton
from memfit.ops.optim_factored import KERNEL_DTYPES
from memfit.optim.states import load_states_as_saved

__all__ = ["FactoredOptimizer"]


class FactoredOptimizer(torch.optim.Optimizer):
    check_options: Callable[[dict[str, Any]], None]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        type(self).check_options(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_states_as_saved(self, state_dict)  # (torch would cast them to bf16 parameters')

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            together: dict[tuple, list[Tensor]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                step = self._count_step(param, group)
                if step is None:
                    continue
                key = None
                if use_triton(param) and param.dim() >= 2 and param.is_contiguous():
                    key = self.together_key(param, step)
                if key is None:
                    self.update_alone(param, group, step)
                else:
                    together.setdefault(key, []).append(param)
            for (step, *_), params in together.items():
                self.update_together(params, group, step)
        return loss

    def _count_step(self, param: Tensor, group: dict[str, Any]) -> float | None:
        """Check the parameter, create its states, count the step; the step (None: nothing to
        update, an empty parameter)."""
        name = type(self).__name__
        if param.grad.is_sparse:
            raise RuntimeError(
                f"{name} does not take sparse gradients (a parameter of shape "
                f"{tuple(param.shape)}); use a dense embedding (sparse=False)"
            )
        if param.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"{name}: parameters must be float32, bfloat16 or float16, got {param.dtype}"
            )
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            self.init_state(param, state)
        if self.has_momentum(group) and "momentum" not in state:
            state["momentum"] = param.new_zeros(param.shape)
        state["step"] += 1
        if param.numel() == 0:
            return None
        return state["step"].item()  # a CPU tensor: no wait for the GPU

    def momenta(self, params: list[Tensor], group: dict[str, Any]) -> list[Tensor] | None:
        """The momentum of each parameter, or None when the group has none."""
        if not self.has_momentum(group):
            return None
        return [self.state[p]["momentum"] for p in params]

    # -- what a subclass supplies ---------------------------------------------------------------

    def init_state(self, param: Tensor, state: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def has_momentum(self, group: dict[str, Any]) -> bool:
        raise NotImplementedError

    def together_key(self, param: Tensor, step: float) -> tuple | None:
        """The key of the launch a contiguous matrix on the GPU shares (its first item the
        step), or None: it steps alone."""
        raise NotImplementedError

    def update_together(self, params: list[Tensor], group: dict[str, Any], step: float) -> None:
        raise NotImplementedError

    def update_alone(self, param: Tensor, group: dict[str, Any], step: float) -> None:
        raise NotImplementedError
