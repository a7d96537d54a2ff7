"""Loading an optimizer's state without torch's casts: torch.optim.Optimizer.load_state_dict
turns every floating-point state into its parameter's dtype, which would make 8-bit AdamW's
codes floats and round the fp32 statistics of a bf16 parameter (Adafactor, SM3, AdamW8bit's
32-bit moments). Here each state keeps the dtype it was saved in, on the parameter's device,
and the step counters stay fp32 CPU tensors (reading them never waits for the GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["load_states_as_saved"]


def load_states_as_saved(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    convert: Callable[[Tensor, dict, dict], dict] | None = None,
) -> None:
    """torch's load_state_dict for the groups and their hyperparameters, then each saved state
    as it was saved (copies). convert(param, group, state) -> state: the optimizer's own
    conversion of a state it also takes in another form (AdamW8bit's per-element checkpoints)."""
    saved = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    places = [(param, group) for group in optimizer.param_groups for param in group["params"]]
    for index, values in saved.items():
        param, group = places[index]
        state = {
            key: value.detach().to("cpu", torch.float32, copy=True)
            if key == "step"
            else value.detach().to(param.device, copy=True)
            for key, value in values.items()
        }
        optimizer.state[param] = convert(param, group, state) if convert else state
