"""The SwiGLU feed-forward block (Shazeer 2020): down(silu(gate(x)) * up(x)).

gate and up are one fused projection `gate_up` (rows gate | up): one larger matrix product
instead of two. Under tensor parallelism the fused weight is split per shard by interleaving:
shard i holds rows [gate_i | up_i], which the state-dict adapter lays out when it loads, so each
shard's `swiglu` sees its own gate and up halves side by side (unfusing would cost a launch)."""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

from memfit.nn.linear import Linear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """down(swiglu(gate_up(x))) (+ residual): at one row (a batch-1 decode step) the
        SwiGLU runs inside gate_up's matrix-vector kernel and the add inside down's."""
        return self.down(self.gate_up(x, swiglu=True), residual=residual)
